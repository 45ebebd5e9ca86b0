"""The model families beyond Llama's dense core through the engine (Mixture of Experts, Phi-3,
Gemma 3, DeepSeek-V2's and V3's latent attention): greedy tokens equal transformers' on the same
weights with chunked prefill and prefix caching, under both preemption modes, and split over two
tensor-parallel ranks (for MoE: each expert's inner width split, the partial sums reduced)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import generate_ids, make_llm, shared_prefix_prompts
from test_invariance import skip_tp_off_the_host

from octavo import SamplingParams
from octavo.testing.tiny_models import TinyModelSpec, write_tiny_model

GEMMA3 = TinyModelSpec(
    "Gemma3ForCausalLM",
    num_hidden_layers=3,
    head_dim=16,
    tie_word_embeddings=True,
    extra_config=(
        ("sliding_window", 8),
        ("layer_types", ("sliding_attention", "full_attention", "sliding_attention")),
        ("query_pre_attn_scalar", 24),
        ("final_logit_softcapping", 30.0),
    ),
    seed=24,
)

DEEPSEEK_V3 = dict(
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    num_experts=8,
    extra_config=(
        ("kv_lora_rank", 32),
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

DEEPSEEK_V2 = {  # V3's shapes without its router's settings (V2 has no rope_interleave)
    **DEEPSEEK_V3,
    "extra_config": tuple(
        kv
        for kv in DEEPSEEK_V3["extra_config"]
        if kv[0] not in ("rope_interleave", "n_group", "topk_group")
    ),
}
V2_GROUPED = (("topk_method", "group_limited_greedy"), ("n_group", 4), ("topk_group", 2))

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
FAMILIES = {
    # 8 experts, 2 per token, renormalised; layer 2 dense (mlp_only_layers)
    "qwen3-moe": TinyModelSpec(
        "Qwen3MoeForCausalLM",
        num_hidden_layers=3,
        head_dim=32,
        num_experts=8,
        extra_config=(("norm_topk_prob", True), ("mlp_only_layers", (2,))),
        seed=21,
    ),
    "mixtral": TinyModelSpec("MixtralForCausalLM", num_experts=4, seed=22),
    "phi3": TinyModelSpec("Phi3ForCausalLM", sliding_window=16, seed=23),
    "gemma3": GEMMA3,
    "deepseek-v3": TinyModelSpec(
        "DeepseekV3ForCausalLM",
        **{**DEEPSEEK_V3, "extra_config": DEEPSEEK_V3["extra_config"] + (("q_lora_rank", 48),)},
        seed=25,
    ),
    "deepseek-v3-no-q-lora": TinyModelSpec(  # q_proj instead of q_a/q_b (V2-Lite's layout)
        "DeepseekV3ForCausalLM",
        **{**DEEPSEEK_V3, "extra_config": DEEPSEEK_V3["extra_config"] + (("q_lora_rank", None),)},
        seed=26,
    ),
    "deepseek-v2": TinyModelSpec(  # q_a/q_b, plain top-k (topk_method greedy)
        "DeepseekV2ForCausalLM",
        **{**DEEPSEEK_V2, "extra_config": DEEPSEEK_V2["extra_config"] + (("q_lora_rank", 48),)},
        seed=27,
    ),
    "deepseek-v2-lite-grouped": TinyModelSpec(  # q_proj; 4 groups, the 2 of the best experts
        "DeepseekV2ForCausalLM",
        **{
            **DEEPSEEK_V2,
            "extra_config": DEEPSEEK_V2["extra_config"] + (("q_lora_rank", None),) + V2_GROUPED,
        },
        seed=28,
    ),
}


def kv_bytes_per_token(spec: TinyModelSpec) -> int:
    """A float32 model's KV bytes per token across its layers: K and V of each KV head, or
    under latent attention one row of the latent and the rotary key."""
    extra = dict(spec.extra_config)
    if "kv_lora_rank" in extra:
        return spec.num_hidden_layers * (extra["kv_lora_rank"] + extra["qk_rope_head_dim"]) * 4
    head_dim = spec.head_dim or spec.hidden_size // spec.num_attention_heads
    return spec.num_hidden_layers * 2 * spec.num_key_value_heads * head_dim * 4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(model folder, 8 prompts sharing prefixes, transformers' greedy tokens for each)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("moe")
    folder = write_tiny_model(root / request.param, FAMILIES[request.param])
    prompts = shared_prefix_prompts(8, seed=7)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                pad_token_id=0,
                eos_token_id=None,
            )
            expected.append(out[0, len(prompt) :].tolist())
    return folder, prompts, expected


def test_chunked_prefill_and_prefix_caching_match_transformers(family):
    folder, prompts, expected = family
    llm = make_llm(folder, enable_prefix_caching=True, max_num_batched_tokens=16)
    assert generate_ids(llm, prompts, GREEDY) == expected
    assert generate_ids(llm, prompts, GREEDY) == expected  # the second time from the cache
    assert llm.engine.core.kv_cache_manager.prefix_cache_hits > 0


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preempted_requests_match_transformers(family, preemption_mode):
    folder, prompts, expected = family
    spec = FAMILIES[folder.name]
    block_bytes = kv_bytes_per_token(spec) * 16
    llm = make_llm(  # 10 blocks of 16 tokens: room for two or three of the requests at once
        folder,
        kv_cache_memory=10 * block_bytes,
        max_model_len=128,
        preemption_mode=preemption_mode,
        swap_space=0.01,
        max_num_batched_tokens=64,
    )
    assert generate_ids(llm, prompts, GREEDY) == expected
    assert llm.engine.core.scheduler.stats.num_preempted_total > 0


def test_two_tensor_parallel_ranks_match_transformers(family):
    skip_tp_off_the_host(2)
    folder, prompts, expected = family
    llm = make_llm(folder, tensor_parallel_size=2, kv_cache_memory="4MiB")
    assert generate_ids(llm, prompts, GREEDY) == expected


def test_the_kv_pool_holds_what_each_family_stores_per_token(family):
    """The runner sizes blocks from the backends' layouts: under latent attention a token costs
    its latent and rotary key once per layer, not K and V of every head."""
    folder, _, _ = family
    llm = make_llm(folder)
    assert (
        llm.engine.core.runner.kv_cache_bytes_per_block()
        == kv_bytes_per_token(FAMILIES[folder.name]) * 16
    )
