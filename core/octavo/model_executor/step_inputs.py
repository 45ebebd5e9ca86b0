"""One step's flat batch as the model and the sampler take it, and the persistent host buffers
(mirrored on the device) it is gathered into."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from octavo.platform.types import AttentionMetadata


def ragged_index(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(row, offset)`` of each item of rows holding ``counts [S]`` items, flat in row order."""
    counts = np.asarray(counts, dtype=np.int64)
    if len(counts) == 1:  # a batch-1 step, ~10 calls a speculative one: 2 numpy calls, not 8
        n = int(counts[0])
        return np.zeros(n, dtype=np.int64), np.arange(n, dtype=np.int64)
    row = np.repeat(np.arange(len(counts)), counts)
    offset = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return row, offset


@dataclasses.dataclass(slots=True)
class StepInputs:
    """One step's flat batch, ready for the model."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    num_scheduled: np.ndarray  # [R]
    sample_rows: np.ndarray  # [S] batch rows that sample this step
    logits_indices: Optional[torch.Tensor]
    """Tokens whose logits are taken: each sampling row's last, or with drafts its last
    ``1 + k_r``; None: every token is a sampling row's last (all decodes, no drafts)."""
    num_drafts: Optional[np.ndarray] = None
    """``[R]`` draft tokens each row verifies this step (after its new token); None: none."""
    draft_token_ids: Optional[torch.Tensor] = None
    """``[N]`` the sampling rows' drafts, flat in row order (N = their ``num_drafts`` sum)."""
    propose_all: bool = True
    """Whether the proposer drafts for every sampling row (else only for seeded ones)."""


class StepBuffer:
    """A persistent host tensor with a numpy view, mirrored on the device when it is not the host;
    ``pin`` (the platform's ``Capabilities.pin_host_memory``) page-locks the host tensor."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device, pin: bool = False):
        on_host = device.type == "cpu"
        self.cpu = torch.zeros(size, dtype=dtype, pin_memory=pin)
        self.np = self.cpu.numpy()
        self.dev = self.cpu if on_host else torch.zeros(size, dtype=dtype, device=device)

    def to_device(self, n: int) -> torch.Tensor:
        if self.dev is not self.cpu:
            self.dev[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.dev[:n]
