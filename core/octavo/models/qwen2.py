"""Qwen2: Llama with biases on the q/k/v projections (none on the output projection)."""

from __future__ import annotations

from typing import Optional

from octavo.models.llama import LlamaForCausalLM


def qwen_sliding_window(hf_config, layer_idx: int) -> Optional[int]:
    """Qwen's window rule: only with ``use_sliding_window``, on layers typed
    ``sliding_attention`` (or, without ``layer_types``, from ``max_window_layers`` on)."""
    window = hf_config.get("sliding_window")
    if not hf_config.get("use_sliding_window") or window is None:
        return None
    layer_types = hf_config.get("layer_types")
    if layer_types:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window if layer_idx >= hf_config.get("max_window_layers", 0) else None


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2ForCausalLM."""

    @classmethod
    def attention_biases(cls, config) -> tuple[bool, bool]:
        return True, False

    @classmethod
    def sliding_window(cls, config, layer_idx: int) -> Optional[int]:
        return qwen_sliding_window(config.hf_config, layer_idx)
