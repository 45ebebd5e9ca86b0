"""Block copies the manager plans and the worker performs: copy-on-write and swap.

The manager only does bookkeeping; every change of KV contents it implies is logged here in
planning order. The worker applies one step's log, in order, before that step's forward pass.
Applying in planning order is what makes any mix of swap-outs, copy-on-writes and swap-ins within
one step safe: each copy sees exactly the contents it saw when it was planned.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Sequence

import torch

from octavo.platform.types import AttentionBackend


class TransferKind(enum.Enum):
    """Which caches a transfer reads and writes."""

    COPY = "copy"  # device -> device (copy-on-write)
    SWAP_OUT = "swap_out"  # device -> host
    SWAP_IN = "swap_in"  # host -> device


@dataclasses.dataclass(frozen=True, slots=True)
class BlockTransfer:
    """Copy blocks ``src[i] -> dst[i]``; within one transfer all reads happen before any write."""

    kind: TransferKind
    src: tuple[int, ...]
    dst: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class BlockTableUpdate:
    """Copy-on-write moved logical block ``block_index`` of a request to ``block_id``."""

    request_id: str
    block_index: int
    block_id: int


@dataclasses.dataclass(frozen=True, slots=True)
class PendingCopies:
    """One step's KV work for the worker: apply ``transfers`` in order (``apply_block_transfers``),
    then rewrite the block-table entries in ``block_table_updates``, then run the forward pass."""

    transfers: tuple[BlockTransfer, ...] = ()
    block_table_updates: tuple[BlockTableUpdate, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.transfers or self.block_table_updates)


class TransferLog:
    """Accumulates one step's transfers, merging consecutive ones of a kind when that is safe."""

    __slots__ = ("_done", "_kind", "_src", "_dst", "_dst_set")

    def __init__(self) -> None:
        self._done: list[BlockTransfer] = []
        self._kind: Optional[TransferKind] = None
        self._src: list[int] = []
        self._dst: list[int] = []
        self._dst_set: set[int] = set()

    def add(self, kind: TransferKind, src: Sequence[int], dst: Sequence[int]) -> None:
        """Log ``src[i] -> dst[i]`` after everything logged so far."""
        if not src:
            return
        if kind is not self._kind or self._conflicts(kind, src, dst):
            self._close()
            self._kind = kind
        self._src.extend(src)
        self._dst.extend(dst)
        self._dst_set.update(dst)

    def _conflicts(self, kind: TransferKind, src: Sequence[int], dst: Sequence[int]) -> bool:
        # A merged transfer reads everything first, so a block written earlier in it must not be
        # read or written again (sources and destinations share one id space only for COPY).
        written = self._dst_set
        if any(d in written for d in dst):
            return True
        return kind is TransferKind.COPY and any(s in written for s in src)

    def _close(self) -> None:
        if self._kind is not None and self._src:
            self._done.append(BlockTransfer(self._kind, tuple(self._src), tuple(self._dst)))
        self._kind, self._src, self._dst, self._dst_set = None, [], [], set()

    def take(self) -> tuple[BlockTransfer, ...]:
        """Everything logged, in order; the log starts empty again."""
        self._close()
        done, self._done = tuple(self._done), []
        return done


def allocate_host_caches(
    backend: AttentionBackend,
    num_layers: int,
    num_host_blocks: int,
    dtype: torch.dtype,
    pin_memory: bool = False,
) -> list[torch.Tensor]:
    """One host-memory cache per layer, in the backend's layout, for swapped-out blocks;
    ``pin_memory`` is the platform's ``Capabilities.pin_host_memory`` (page-locked memory, so
    swaps to and from the device can run asynchronously)."""
    shape = backend.kv_cache_shape(num_host_blocks)
    return [
        torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=pin_memory)
        for _ in range(num_layers)
    ]


def apply_block_transfers(
    backend: AttentionBackend,
    device_caches: Sequence[torch.Tensor],
    host_caches: Sequence[torch.Tensor],
    transfers: Sequence[BlockTransfer],
) -> None:
    """Perform ``transfers`` in order on every layer with the backend's copy and swap kernels."""
    if not transfers:
        return
    device = device_caches[0].device
    for transfer in transfers:
        src = torch.tensor(transfer.src, dtype=torch.long)
        dst = torch.tensor(transfer.dst, dtype=torch.long)
        if transfer.kind is TransferKind.COPY:
            src, dst = src.to(device), dst.to(device)
            for cache in device_caches:
                backend.copy_blocks(cache, src, dst)
            continue
        if len(host_caches) != len(device_caches):
            raise ValueError(
                f"swapping needs one host cache per layer: {len(host_caches)} for "
                f"{len(device_caches)} layers"
            )
        for device_cache, host_cache in zip(device_caches, host_caches):
            if transfer.kind is TransferKind.SWAP_OUT:
                backend.swap_blocks(device_cache, host_cache, src, dst)
            else:
                backend.swap_blocks(host_cache, device_cache, src, dst)
