"""A stand-in worker for KV cache tests: real caches in the default layout that record, in every
slot, the token id (K half) and position (V half) written there.

Contents change only through the manager's planned transfers (applied with the platform's
``AttentionBackend.copy_blocks``/``swap_blocks``) and through "forward" writes at the slots the
request's block table gives, so reading a request back through its table checks the manager's
bookkeeping end to end.
"""

from __future__ import annotations

import torch

from octavo.kv_cache import KVCacheManager, apply_block_transfers
from octavo.platform.types import AttentionBackend, AttentionSpec
from octavo.request import Request

EMPTY = -1


class SimWorker:
    """Device and host KV caches for ``num_layers`` layers, driven by one manager."""

    def __init__(self, manager: KVCacheManager, num_layers: int = 2):
        self.manager = manager
        self.block_size = manager.block_size
        spec = AttentionSpec(
            num_heads=1,
            num_kv_heads=1,
            head_dim=1,
            dtype=torch.int64,
            block_size=self.block_size,
            scale=1.0,
        )
        self.backend = AttentionBackend(spec)
        num_blocks = manager.block_pool.num_blocks
        num_host_blocks = manager.host_pool.num_blocks
        self.device_caches = [
            torch.full(self.backend.kv_cache_shape(num_blocks), EMPTY) for _ in range(num_layers)
        ]
        self.host_caches = [
            torch.full(self.backend.kv_cache_shape(num_host_blocks), EMPTY)
            for _ in range(num_layers)
        ]

    def apply_pending(self) -> None:
        """What a worker does first in a step: the planned copies, in order."""
        pending = self.manager.take_pending_copies()
        apply_block_transfers(self.backend, self.device_caches, self.host_caches, pending.transfers)

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end)
        table = torch.tensor(block_ids, dtype=torch.long)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def write(self, request: Request, start: int, end: int) -> None:
        """The forward pass's KV write for positions ``[start, end)`` of ``request``."""
        slots = self._slots(self.manager.get_block_ids(request.request_id), start, end)
        tokens = torch.tensor(request.all_token_ids[start:end])
        for cache in self.device_caches:
            cache[0].view(-1)[slots] = tokens
            cache[1].view(-1)[slots] = torch.arange(start, end)

    def read(
        self, block_ids: list[int], num_tokens: int, host: bool = False
    ) -> list[tuple[list[int], list[int]]]:
        """(token ids, positions) of the first ``num_tokens`` logical slots, for every layer."""
        slots = self._slots(block_ids, 0, num_tokens)
        caches = self.host_caches if host else self.device_caches
        return [
            (cache[0].view(-1)[slots].tolist(), cache[1].view(-1)[slots].tolist())
            for cache in caches
        ]

    def assert_holds(self, request: Request, num_tokens: int | None = None) -> None:
        """The request's first ``num_tokens`` (default: computed) tokens read back through its
        table."""
        n = request.num_computed_tokens if num_tokens is None else num_tokens
        expected = (request.all_token_ids[:n], list(range(n)))
        for layer, got in enumerate(self.read(self.manager.get_block_ids(request.request_id), n)):
            assert got == expected, f"layer {layer} of {request}: {got} != {expected}"

    def assert_host_holds(self, request: Request) -> None:
        """A swapped-out request's computed tokens read back from its host blocks."""
        n = request.num_computed_tokens
        expected = (request.all_token_ids[:n], list(range(n)))
        for layer, got in enumerate(
            self.read(self.manager.get_host_block_ids(request.request_id), n, host=True)
        ):
            assert got == expected, f"host layer {layer} of {request}: {got} != {expected}"

    def block_contents(self, block_id: int) -> tuple[list[int], list[int]]:
        """(token ids, positions) stored in one device block (layer 0)."""
        cache = self.device_caches[0]
        return cache[0, block_id].view(-1).tolist(), cache[1, block_id].view(-1).tolist()


def run_chunk(worker: SimWorker, request: Request, num_new_tokens: int) -> None:
    """Execute one scheduled chunk: apply the step's copies, write its KV, advance the request."""
    worker.apply_pending()
    start = request.num_computed_tokens
    worker.write(request, start, start + num_new_tokens)
    request.num_computed_tokens += num_new_tokens
