"""The tiny models and prompts the model tests share."""

from __future__ import annotations

import random

from octavo.testing.tiny_models import TinyModelSpec

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

GEMMA3_OPTIONS = dict(
    num_hidden_layers=3,
    head_dim=16,
    tie_word_embeddings=True,
    extra_config=(
        ("sliding_window", 8),
        ("layer_types", ("sliding_attention", "full_attention", "sliding_attention")),
        ("query_pre_attn_scalar", 24),
        ("final_logit_softcapping", 30.0),
        (
            "rope_parameters",
            {
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
)

DEEPSEEK_V3_OPTIONS = dict(
    rope_scaling={  # DeepSeek-V3's YaRN, over a 64-token original context
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    num_attention_heads=4,
    num_key_value_heads=4,
    extra_config=(
        ("kv_lora_rank", 32),
        ("q_lora_rank", 48),
        ("qk_rope_head_dim", 8),
        ("qk_nope_head_dim", 16),
        ("v_head_dim", 16),
        ("rope_interleave", True),
        ("n_shared_experts", 1),
        ("n_group", 2),
        ("topk_group", 1),
        ("first_k_dense_replace", 1),
        ("routed_scaling_factor", 2.5),
    ),
)

V3_ONLY = ("rope_interleave", "q_lora_rank", "n_group", "topk_group", "routed_scaling_factor")
DEEPSEEK_V2_OPTIONS = dict(  # V3's shapes, V2-Lite's q_proj and V2's grouped routing
    DEEPSEEK_V3_OPTIONS,
    rope_scaling={  # distinct mscales: the cos/sin and the softmax factors both apply
        **DEEPSEEK_V3_OPTIONS["rope_scaling"],
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
    },
    extra_config=tuple(kv for kv in DEEPSEEK_V3_OPTIONS["extra_config"] if kv[0] not in V3_ONLY)
    + (
        ("q_lora_rank", None),
        ("topk_method", "group_limited_greedy"),
        ("n_group", 4),
        ("topk_group", 2),
        ("routed_scaling_factor", 2.0),
    ),
)

# One tiny model per architecture, each also exercising a feature of its family.
TINY_SPECS = {
    "LlamaForCausalLM": TinyModelSpec("LlamaForCausalLM", rope_scaling=LLAMA3_ROPE, seed=1),
    "MistralForCausalLM": TinyModelSpec("MistralForCausalLM", sliding_window=24, seed=2),
    "Qwen2ForCausalLM": TinyModelSpec("Qwen2ForCausalLM", tie_word_embeddings=True, seed=3),
    "Qwen3ForCausalLM": TinyModelSpec("Qwen3ForCausalLM", head_dim=32, seed=4),
    # MoE: 8 experts, 2 per token, renormalised, layer 1 a dense MLP (mlp_only_layers)
    "Qwen3MoeForCausalLM": TinyModelSpec(
        "Qwen3MoeForCausalLM",
        head_dim=32,
        num_experts=8,
        extra_config=(("norm_topk_prob", True), ("mlp_only_layers", (1,))),
        seed=5,
    ),
    # MoE in every layer: 4 experts of intermediate_size, 2 per token
    "MixtralForCausalLM": TinyModelSpec("MixtralForCausalLM", num_experts=4, seed=6),
    # fused qkv_proj and gate_up_proj in the checkpoint; a sliding window on every layer
    "Phi3ForCausalLM": TinyModelSpec("Phi3ForCausalLM", sliding_window=24, seed=7),
    # sliding (window 8, local RoPE) and full (linear-scaled global RoPE) layers interleaved,
    # q/k norms, query_pre_attn_scalar, logits soft-capped
    "Gemma3ForCausalLM": TinyModelSpec("Gemma3ForCausalLM", **GEMMA3_OPTIONS, seed=8),
    # multi-head latent attention (q through a low-rank q_a/q_b pair, interleaved rotary
    # pairs, YaRN with its softmax mscale), layer 0 dense, then 8 experts in 2 groups
    # (sigmoid, grouped choice, correction bias, scaling) with a shared expert
    "DeepseekV3ForCausalLM": TinyModelSpec(
        "DeepseekV3ForCausalLM", num_hidden_layers=3, num_experts=8, **DEEPSEEK_V3_OPTIONS, seed=10
    ),
    # DeepSeek-V2-Lite's latent attention (a plain q_proj, rotary on interleaved pairs in
    # float32, YaRN), layer 0 dense, then 8 experts in 4 groups (softmax, the 2 groups of the
    # best single experts eligible, not renormalised, scaled) with a shared expert
    "DeepseekV2ForCausalLM": TinyModelSpec(
        "DeepseekV2ForCausalLM", num_hidden_layers=3, num_experts=8, **DEEPSEEK_V2_OPTIONS, seed=11
    ),
}
ARCHITECTURES = tuple(TINY_SPECS)


def make_prompts(lengths, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """BOS followed by random token ids, one prompt per length."""
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, vocab_size) for _ in range(n - 1)] for n in lengths]


PROMPTS = make_prompts((1, 6, 19, 40), 512)


def blocks_needed(prompts, max_tokens: int, block_size: int) -> int:
    """Enough KV blocks for every prompt plus its output, with some to spare."""
    return sum(-(-(len(p) + max_tokens) // block_size) for p in prompts) + 4
