"""Random LoRA adapters for tests and benchmarks, saved by PEFT itself (``peft`` is a test
dependency): the folders ``--lora-modules`` and ``LoRARequest`` take, and the oracle's."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence, Union

import torch

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_lora(
    folder: Union[str, Path],
    base_model: Union[str, Path],
    *,
    rank: int = 8,
    alpha: float = 16,
    target_modules: Sequence[str] = ALL_PROJECTIONS,
    use_rslora: bool = False,
    std: float = 0.2,
    seed: int = 0,
) -> Path:
    """A PEFT adapter of ``base_model`` with random A and B (PEFT starts B at zero, which
    would change nothing), saved as ``adapter_config.json`` + ``adapter_model.safetensors``."""
    import peft
    import transformers

    folder = Path(folder)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(target_modules),
        use_rslora=use_rslora,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(folder, safe_serialization=True)
    return folder
