"""What crosses from the scheduler to the model runner each step (the runner's answer is
``octavo.model_executor.runner_output``).

The scheduler sends full data only for requests a worker has not seen (``NewRequestData``) and
deltas for the rest (``CachedRequestData``); the worker keeps a persistent batch. Ownership of
tokens: **the runner appends every token it samples to its own copy of the request**, so the
scheduler never echoes sampled tokens back; ``new_token_ids`` carries only tokens the runner did
not produce itself; draft tokens to verify come in ``scheduled_spec_token_ids``.

Per step, for each scheduled request, ``num_computed_tokens`` is how many of its tokens already
have K/V in the cache (their blocks are in its block table) and ``num_scheduled_tokens[req_id]``
how many of the following tokens this step computes. The step samples a token for a request when
those reach the end of its known tokens (a partial prefill chunk samples nothing).

A request that is in the runner's batch but absent from ``num_scheduled_tokens`` (and not
finished) is kept but idle; it comes back as a ``CachedRequestData``, with
``resumed_from_preemption=True`` and its whole new block table when it was preempted.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from octavo.kv_cache.transfers import BlockTransfer
from octavo.lora.request import LoRARequest
from octavo.sampling_params import SamplingParams


@dataclasses.dataclass(slots=True)
class NewRequestData:
    """A request the worker has not seen: everything needed to run it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    """Tokens already generated elsewhere (e.g. by a prefill instance); usually empty."""
    lora_request: Optional[LoRARequest] = None
    """The LoRA adapter it runs with (None: the base model)."""


@dataclasses.dataclass(slots=True)
class CachedRequestData:
    """The change since the previous step to a request the worker already holds."""

    req_id: str
    new_block_ids: list[int]
    """Block ids appended to its block table (after the cut ``block_table_start`` asks for)."""
    num_computed_tokens: int
    new_token_ids: list[int] = dataclasses.field(default_factory=list)
    """Tokens to append that the runner did not sample itself (normally empty)."""
    resumed_from_preemption: bool = False
    """Back after preemption: its block table restarts (``block_table_start`` defaults to 0)."""
    block_table_start: Optional[int] = None
    """When set, the block table is cut to this many blocks before ``new_block_ids`` are
    appended: 0 rebuilds it (resumed after preemption), ``len - 1`` replaces the last block
    (copy-on-write, with the copy in ``SchedulerOutput.kv_transfers``)."""


@dataclasses.dataclass(slots=True)
class SchedulerOutput:
    """One step's schedule.

    ``kv_transfers`` are the KV block moves the KV cache manager planned (copy-on-write copies,
    swap-outs to host memory, swap-ins back), applied in order before the forward pass.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = dataclasses.field(default_factory=set)
    kv_transfers: tuple[BlockTransfer, ...] = ()
    scheduled_spec_token_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """Draft tokens to verify, per request: its ``num_scheduled_tokens`` counts them after its
    one new token (speculative decoding)."""
    propose_drafts: bool = True
    """Whether the runner drafts for every request that samples this step (speculative
    decoding); when False only for seeded ones, whose draws depend on their drafts."""

    @classmethod
    def empty(cls) -> "SchedulerOutput":
        return cls([], [], {}, 0)
