"""All-reduce through shared memory for tensor-parallel ranks on one x86 host.

gloo's all-reduce over loopback TCP costs 0.5-0.85 ms even for a few KiB (BENCHMARKS.md, the
tensor-parallel section), about as much as a decode step's compute. Ranks on one host instead
meet in one shared-memory segment: each writes its tensor into its slot, then publishes the
call's sequence number in its flag; each waits for every other rank's flag, then sums the slots
in rank order (so every rank gets the same bits). Slots are double-buffered by the sequence
number's parity: a rank reuses a slot only after every rank has published the next call, which
it does only once it has read the slot. Stores on x86 are not reordered with other stores, nor
loads with loads, so a flag seen means its slot's data is there.

Tensors larger than a slot, all-gather, send and recv go through the group's own collectives.
"""

from __future__ import annotations

import logging
import os
import platform as host
import socket
import tempfile
import time
import uuid
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from octavo.distributed.communicator import TorchDistributedCommunicator

logger = logging.getLogger(__name__)

SHM_ENV = "OCTAVO_CPU_SHM"
SLOT_BYTES = 4 << 20  # a 2048-token step of hidden 1024 in float32; larger ones go to gloo
FLAG_BYTES = 64  # one cache line per rank's flag
SPINS_BEFORE_YIELD = 200
TIMEOUT_S = 600.0


def host_identity() -> str:
    """Names this host's shared memory: the host name and its boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def make_communicator(group: Any) -> TorchDistributedCommunicator:
    """Shared memory when every rank of ``group`` is on this x86 host (a collective: every rank
    calls it) and ``OCTAVO_CPU_SHM`` is not ``0``, else the group's own collectives."""
    hosts: list[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, host_identity(), group=group)
    wanted = os.environ.get(SHM_ENV, "1") != "0"
    if wanted and len(set(hosts)) == 1 and host.machine() in ("x86_64", "AMD64"):
        folder, needed = shm_folder(), segment_bytes(len(hosts))
        free = os.statvfs(folder)
        room = [free.f_bavail * free.f_frsize >= 2 * needed]
        dist.broadcast_object_list(room, src=dist.get_global_rank(group, 0), group=group)
        if room[0]:  # all ranks take rank 0's answer: they must agree
            return SharedMemoryCommunicator(group)
        logger.warning(
            "tensor parallelism: %s has less than %d MiB free (a container's default /dev/shm?); "
            "all-reduce goes through gloo, several times slower: give it more room",
            folder,
            2 * needed >> 20,
        )
    return TorchDistributedCommunicator(group)


def shm_folder() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def segment_bytes(world_size: int) -> int:
    return world_size * (FLAG_BYTES + 2 * SLOT_BYTES)


class SharedMemoryCommunicator(TorchDistributedCommunicator):
    """The group's collectives, with all-reduce through one shared-memory segment: a file in
    ``/dev/shm`` that rank 0 creates and removes once every rank has mapped it."""

    def __init__(self, group: Any):
        super().__init__(group)
        self.rank, world = dist.get_rank(group), self.world_size
        size = segment_bytes(world)
        path = [os.path.join(shm_folder(), f"octavo-tp-{uuid.uuid4().hex}")]
        dist.broadcast_object_list(path, src=dist.get_global_rank(group, 0), group=group)
        if self.rank == 0:
            with open(path[0], "wb") as f:
                f.truncate(size)
        dist.barrier(group=group)
        self.memory = np.memmap(path[0], dtype=np.uint8, mode="r+", shape=(size,))
        dist.barrier(group=group)
        if self.rank == 0:
            os.unlink(path[0])  # the pages live on while mapped
        self.flags = self.memory[: world * FLAG_BYTES].view(np.int64)[:: FLAG_BYTES // 8]
        base = world * FLAG_BYTES
        self.slots = [  # [parity * world + rank]
            torch.from_numpy(self.memory[base + i * SLOT_BYTES : base + (i + 1) * SLOT_BYTES])
            for i in range(2 * world)
        ]
        self.seq = 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > SLOT_BYTES or not tensor.is_contiguous():
            return super().all_reduce(tensor)
        self.seq += 1
        seq, parity, world = self.seq, self.seq % 2, self.world_size
        slots = [
            self.slots[parity * world + r][:nbytes].view(tensor.dtype).view(tensor.shape)
            for r in range(world)
        ]
        slots[self.rank].copy_(tensor)
        self.flags[self.rank] = seq
        for r in range(world):
            if r != self.rank:
                self._wait(r, seq)
        tensor.copy_(slots[0])
        for r in range(1, world):
            tensor.add_(slots[r])
        return tensor

    def _wait(self, rank: int, seq: int) -> None:
        flags, spins = self.flags, 0
        deadline = None
        while flags[rank] < seq:
            spins += 1
            if spins % SPINS_BEFORE_YIELD == 0:
                os.sched_yield()  # the host may have fewer cores than processes
                if deadline is None:
                    deadline = time.monotonic() + TIMEOUT_S
                elif time.monotonic() > deadline:
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} did not reach all-reduce {seq} within "
                        f"{TIMEOUT_S:.0f} s"
                    )
