"""The ``--enable-lora`` family of flags, as vLLM names them."""

from __future__ import annotations

import dataclasses
from typing import Optional

from octavo.errors import ConfigError

SUPPORTED_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM's choices for ``--max-lora-rank`` (a rank below the maximum is zero-padded)."""


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """``max_loras`` adapters share a step (one slot each, beside the base model);
    ``max_cpu_loras`` stay loaded in host memory beyond them (least recently used evicted);
    ``max_lora_rank`` is the largest rank accepted, and the slots' width."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None  # None: max_loras

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1; got {value!r}")
        if self.max_lora_rank not in SUPPORTED_RANKS:
            raise ConfigError(
                f"--max-lora-rank must be one of {', '.join(map(str, SUPPORTED_RANKS))}; "
                f"got {self.max_lora_rank}"
            )
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif self.max_cpu_loras < self.max_loras:
            raise ConfigError(
                f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras "
                f"({self.max_loras}): the adapters in the batch's slots are kept loaded too"
            )
