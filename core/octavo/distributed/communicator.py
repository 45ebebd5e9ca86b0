"""Collectives over a torch.distributed process group: what the model's parallel layers call.

A platform returns one from ``octavo_communicator`` for a group of its backend (gloo on the cpu
platform); every op is the group's own collective, so the results are the same on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class TorchDistributedCommunicator:
    """All-reduce (sum), all-gather, send and receive within ``group``."""

    def __init__(self, group: Any):
        self.group = group
        self.world_size = dist.get_world_size(group)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place in ``tensor`` (returned)."""
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim``, in rank order."""
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.cat(parts, dim=dim)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        dist.send(tensor.contiguous(), dst, group=self.group)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        dist.recv(tensor, src, group=self.group)
        return tensor
