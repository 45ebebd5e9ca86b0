"""Registers the core's model architectures through the same hook a model plugin uses."""

from __future__ import annotations

from octavo.platform import hookimpl


@hookimpl
def octavo_model_architectures():
    """The Llama family: Llama, Mistral, Qwen2 and Qwen3 causal LMs, its Mixture-of-Experts
    members Qwen3-MoE and Mixtral, Phi-3, Gemma 3 (text), DeepSeek-V2 and DeepSeek-V3 (multi-head
    latent attention)."""
    from octavo.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
    from octavo.models.gemma3 import Gemma3ForCausalLM
    from octavo.models.llama import LlamaForCausalLM
    from octavo.models.mistral import MistralForCausalLM
    from octavo.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
    from octavo.models.phi3 import Phi3ForCausalLM
    from octavo.models.qwen2 import Qwen2ForCausalLM
    from octavo.models.qwen3 import Qwen3ForCausalLM

    return {
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": MistralForCausalLM,
        "Qwen2ForCausalLM": Qwen2ForCausalLM,
        "Qwen3ForCausalLM": Qwen3ForCausalLM,
        "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
        "MixtralForCausalLM": MixtralForCausalLM,
        "Phi3ForCausalLM": Phi3ForCausalLM,
        "Gemma3ForCausalLM": Gemma3ForCausalLM,
        "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
        "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    }
