"""One generation request as the scheduler and the KV cache manager see it."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Sequence, Union

from octavo.sampling_params import SamplingParams

if TYPE_CHECKING:
    from octavo.kv_cache.hashing import BlockHash
    from octavo.lora.request import LoRARequest

_DEFAULT_SAMPLING_PARAMS = SamplingParams()  # frozen, so one instance serves every request

BlockHasherFn = Callable[["Request"], "list[BlockHash]"]
"""``fn(request) -> hashes of the blocks that became full since the last call`` (see
``octavo.kv_cache.hashing.BlockHasher``); it also exposes ``block_size``."""


class RequestStatus(enum.IntEnum):
    """Where a request is in its life; every ``FINISHED_*`` status compares above ``SWAPPED``."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    SWAPPED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_IGNORED = 7
    FINISHED_ERROR = 8

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.SWAPPED


class Request:
    """Prompt and output token ids, progress, and the chained hashes of its full blocks.

    ``num_computed_tokens`` counts tokens whose KV is in the cache. ``block_hashes[i]`` is the
    hash of full block ``i`` of ``all_token_ids``; it is extended as blocks fill and survives
    preemption, so a resumed request never re-hashes. The engine appends sampled tokens only with
    ``append_output_token_ids`` (it keeps ``all_token_ids`` and ``block_hashes`` in step).
    ``spec_token_ids`` are the drafts proposed for its next step (speculative decoding): never
    part of its tokens, never hashed.
    ``lora_request`` names the LoRA adapter it runs with (None: the base model); its id is
    ``lora_id``, part of every block's hash.
    ``mm_positions[j]`` is the ``(offset, length)`` of the placeholder tokens of the multimodal
    input hashed ``mm_hashes[j]``; without positions every multimodal hash keys the first block.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "arrival_time",
        "priority",
        "cache_salt",
        "lora_id",
        "lora_request",
        "mm_hashes",
        "mm_positions",
        "status",
        "num_computed_tokens",
        "block_hashes",
        "spec_token_ids",
        "_output_token_ids",
        "_all_token_ids",
        "_block_hasher",
        "_block_size",
        "_next_hash_at",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: Optional[SamplingParams] = None,
        *,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        lora_id: Union[int, str, None] = None,
        lora_request: Optional["LoRARequest"] = None,
        mm_hashes: Sequence[str] = (),
        mm_positions: Optional[Sequence[tuple[int, int]]] = None,
        block_hasher: Optional[BlockHasherFn] = None,
    ):
        if mm_positions is not None and len(mm_positions) != len(mm_hashes):
            raise ValueError(
                f"request {request_id!r}: mm_positions has {len(mm_positions)} entries but "
                f"mm_hashes has {len(mm_hashes)}; give one (offset, length) per multimodal input"
            )
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = (
            _DEFAULT_SAMPLING_PARAMS if sampling_params is None else sampling_params
        )
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        # the adapter keys the prefix cache (SPEC C2): KV computed under it is its own
        self.lora_id = lora_request.lora_int_id if lora_request is not None else lora_id
        self.mm_hashes = tuple(mm_hashes)
        self.mm_positions = None if mm_positions is None else tuple(mm_positions)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self._output_token_ids: list[int] = []
        self._all_token_ids = list(self.prompt_token_ids)
        self._block_hasher = block_hasher
        self._block_size = block_hasher.block_size if block_hasher is not None else 0
        self.block_hashes: list[BlockHash] = []
        self.spec_token_ids: list[int] = []
        self._next_hash_at = 0  # num_tokens at which the next block fills (0: no hasher)
        if block_hasher is not None:
            self._hash_new_blocks()

    def _hash_new_blocks(self) -> None:
        self.block_hashes.extend(self._block_hasher(self))
        self._next_hash_at = (len(self.block_hashes) + 1) * self._block_size

    @property
    def output_token_ids(self) -> list[int]:
        """The sampled tokens so far (append with ``append_output_token_ids``)."""
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output tokens."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.SWAPPED

    @property
    def skip_prefix_cache_lookup(self) -> bool:
        """Prompt logprobs need logits for every prompt token, so cached KV cannot stand in."""
        return self.sampling_params.prompt_logprobs is not None

    def append_output_token_ids(self, token_ids: Union[int, Iterable[int]]) -> None:
        """Append sampled tokens, hashing any block they fill."""
        if isinstance(token_ids, int):
            self._output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
        else:
            token_ids = list(token_ids)
            self._output_token_ids.extend(token_ids)
            self._all_token_ids.extend(token_ids)
        if self._next_hash_at and len(self._all_token_ids) >= self._next_hash_at:
            self._hash_new_blocks()

    def fork(self, request_id: str) -> "Request":
        """A child with the same tokens, progress and block hashes (for n>1 and beam search).

        Pair it with ``KVCacheManager.fork(parent, child)`` so the child shares the KV blocks.
        """
        child = Request.__new__(Request)
        for name in Request.__slots__:
            setattr(child, name, getattr(self, name))
        child.request_id = request_id
        child._output_token_ids = list(self._output_token_ids)
        child._all_token_ids = list(self._all_token_ids)
        child.block_hashes = list(self.block_hashes)
        child.spec_token_ids = []
        return child

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )
