"""How a request names its LoRA adapter: vLLM's ``LoRARequest(lora_name, lora_int_id,
lora_path)``, so offline code written for vLLM runs unchanged."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a positive integer id unique per adapter, and its PEFT folder.

    ``lora_int_id`` keys the prefix cache (two adapters never share cached KV) and the
    adapter's slot; ``base_model_name`` is what ``/v1/models`` lists as its parent."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string; got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"lora_int_id must be an integer; got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(
                f"lora_int_id must be >= 1 (0 and below are the base model); "
                f"got {self.lora_int_id} for adapter {self.lora_name!r}"
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(
                f"lora_path of adapter {self.lora_name!r} must be a folder path; "
                f"got {self.lora_path!r}"
            )
