"""Mistral: Llama with a sliding attention window on every layer (``sliding_window``)."""

from __future__ import annotations

from typing import Optional

from octavo.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """MistralForCausalLM: no biases; ``sliding_window`` (when set) applies to all layers."""

    @classmethod
    def attention_biases(cls, config) -> tuple[bool, bool]:
        return False, False

    @classmethod
    def sliding_window(cls, config, layer_idx: int) -> Optional[int]:
        return config.hf_config.get("sliding_window")
