"""Phi-3: Llama with the checkpoint's q/k/v and gate/up projections stored fused
(``qkv_proj``, ``gate_up_proj``) and Mistral's sliding window on every layer.

The fused checkpoint tensors are split into their parts at load, so each part goes through the
same per-shard loader as Llama's (a tensor-parallel rank keeps its heads and rows of each).
"""

from __future__ import annotations

from typing import Iterable

import torch

from octavo.errors import ConfigError
from octavo.models.layers.linear import materialize
from octavo.models.mistral import MistralForCausalLM
from octavo.models.weights import LoadedTensor

FUSED_PARTS = {
    ".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj."),
    ".gate_up_proj.": (".gate_proj.", ".up_proj."),
}


class Phi3ForCausalLM(MistralForCausalLM):
    """Phi3ForCausalLM (Phi-3, Phi-3.5 and Phi-4-mini's layout) with default RoPE over the whole
    head; ``longrope`` scaling and a partial rotary factor are refused at load."""

    def __init__(self, config, platform, **kwargs):
        factor = (config.hf_config.get("rope_parameters") or {}).get(
            "partial_rotary_factor", config.hf_config.get("partial_rotary_factor", 1.0)
        )
        if float(factor) != 1.0:
            raise ConfigError(
                f"partial_rotary_factor {factor}: octavo's rotary embedding rotates whole heads; "
                "this Phi-3 checkpoint rotates part of each head"
            )
        super().__init__(config, platform, **kwargs)

    def _part_sizes(self, fused: str) -> tuple[int, ...]:
        config = self.config
        if fused == ".gate_up_proj.":
            return (config.intermediate_size, config.intermediate_size)
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        return (q, kv, kv)

    def _split_fused(
        self, weights: Iterable[tuple[str, LoadedTensor]]
    ) -> Iterable[tuple[str, LoadedTensor]]:
        for name, tensor in weights:
            fused = next((f for f in FUSED_PARTS if f in name), None)
            if fused is None:
                yield name, tensor
                continue
            sizes = self._part_sizes(fused)
            if tensor.shape[0] != sum(sizes):
                raise ConfigError(
                    f"checkpoint tensor {name!r} has {tensor.shape[0]} rows but the model config "
                    f"implies {sum(sizes)} ({' + '.join(map(str, sizes))})"
                )
            for part, piece in zip(FUSED_PARTS[fused], torch.split(materialize(tensor), sizes)):
                yield name.replace(fused, part), piece

    def load_weights(self, weights: Iterable[tuple[str, LoadedTensor]]) -> set[str]:
        consumed = super().load_weights(self._split_fused(weights))
        return {_fused_name(name) for name in consumed}

    def checkpoint_tensor_names(self) -> set[str]:
        return {_fused_name(name) for name in super().checkpoint_tensor_names()}


def _fused_name(name: str) -> str:
    """The checkpoint's name of a part's tensor (``.q_proj.`` -> ``.qkv_proj.``)."""
    for fused, parts in FUSED_PARTS.items():
        for part in parts:
            if part in name:
                return name.replace(part, fused)
    return name
