"""A step's token -> LoRA slot mapping, grouped by slot once for every layer of the step."""

from __future__ import annotations

import numpy as np
import torch

from octavo.platform.types import LoRAMapping


def build_lora_mapping(token_slots: np.ndarray, device: torch.device) -> LoRAMapping:
    """The :class:`LoRAMapping` of ``token_slots [T]`` (-1: the base model), with array
    operations only."""
    token_slots = np.asarray(token_slots, dtype=np.int64)
    with_adapter = np.flatnonzero(token_slots >= 0)
    slots_of = token_slots[with_adapter]
    order = np.argsort(slots_of, kind="stable")
    segment_slots, counts = np.unique(slots_of, return_counts=True)
    starts = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    return LoRAMapping(
        token_slots=torch.from_numpy(token_slots).to(device),
        sorted_tokens=torch.from_numpy(with_adapter[order]).to(device),
        segment_slots=torch.from_numpy(segment_slots).to(device),
        segment_starts=torch.from_numpy(starts).to(device),
        host_segment_slots=tuple(segment_slots.tolist()),
        host_segment_starts=tuple(starts.tolist()),
        max_segment_length=int(counts.max()) if len(counts) else 0,
    )
