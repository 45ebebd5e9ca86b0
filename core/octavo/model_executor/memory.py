"""Peak memory of a block of work, for sizing the KV cache after the profile run.

On an accelerator with allocator statistics (``torch.accelerator``) the allocator's peak is
used. Elsewhere (the host CPU) a dispatch mode counts the bytes of every storage an operator
creates and releases, which gives the peak of live tensors the work allocated.
"""

from __future__ import annotations

import math
import mmap
import weakref
from typing import Sequence, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _has_storage(t) -> bool:
    """A tensor with a storage to count (an opaque one, e.g. a oneDNN packed weight, has none)."""
    return isinstance(t, torch.Tensor) and not t.is_mkldnn


class _LiveStorageCounter(TorchDispatchMode):
    """Counts bytes of storages created inside the mode, live and at their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._tracked.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if _has_storage(t)
        }
        for t in tree_flatten(out)[0]:
            if not _has_storage(t):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in inputs or key in self._tracked:
                continue  # a view or an in-place result of something that already existed
            self._tracked.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._release, key, nbytes)
        return out


class PeakMemory:
    """``with PeakMemory(device) as peak: ...`` then ``peak.bytes``: the most memory the block
    held at once beyond what was allocated before it."""

    def __init__(self, device: Union[str, torch.device]):
        self.device = torch.device(device)
        self.bytes = 0
        self._use_allocator = (
            self.device.type != "cpu"
            and torch.accelerator.is_available()
            and torch.accelerator.current_accelerator().type == self.device.type
        )
        self._counter = None if self._use_allocator else _LiveStorageCounter()

    def __enter__(self) -> "PeakMemory":
        if self._use_allocator:
            torch.accelerator.synchronize(self.device)
            torch.accelerator.reset_peak_memory_stats(self.device)
            self._baseline = torch.accelerator.memory_allocated(self.device)
        else:
            self._counter.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._use_allocator:
            torch.accelerator.synchronize(self.device)
            self.bytes = torch.accelerator.max_memory_allocated(self.device) - self._baseline
        else:
            self._counter.__exit__(*exc)
            self.bytes = self._counter.peak


def zeros_on_touch(
    shape: Sequence[int], dtype: torch.dtype, device: Union[str, torch.device]
) -> torch.Tensor:
    """A zero tensor for a large cache. On the host CPU it lives in anonymous memory, which the
    operating system hands out already zeroed, page by page, when first touched: a KV cache of
    several GiB then costs no start-up time (``torch.zeros`` writes every page: ~10 s for 8 GiB
    here) and only the pages in use count against resident memory. Elsewhere ``torch.zeros``."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(tuple(shape), dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(tuple(shape))
