"""Tiny models and engines the tpu tests share: the tpu platform (Pallas interpreted) beside the
cpu platform as the oracle, in float32."""

from __future__ import annotations

import random
from pathlib import Path

from octavo import LLM
from octavo.testing.tiny_models import TinyModelSpec, write_tiny_model

# One tiny model per family member, each with what sets it apart: llama3 RoPE scaling, a
# sliding window shorter than the prompts, q/k/v biases with tied embeddings, Qwen3's q/k
# norms with a head size of 32.
SPECS = {
    "llama": TinyModelSpec(
        "LlamaForCausalLM",
        max_position_embeddings=256,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        seed=1,
    ),
    "mistral": TinyModelSpec(
        "MistralForCausalLM", max_position_embeddings=256, sliding_window=12, seed=2
    ),
    "qwen2": TinyModelSpec(
        "Qwen2ForCausalLM", max_position_embeddings=256, tie_word_embeddings=True, seed=3
    ),
    "qwen3": TinyModelSpec("Qwen3ForCausalLM", max_position_embeddings=256, head_dim=32, seed=4),
}

ENGINE_ARGS = dict(dtype="float32", kv_cache_memory="2MiB", max_num_seqs=8)


def write_model(folder: Path, name: str) -> Path:
    return write_tiny_model(folder / name, SPECS[name])


def prompts(lengths, seed: int = 0, vocab_size: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, vocab_size) for _ in range(n - 1)] for n in lengths]


def engine(model: Path, device: str, **args) -> LLM:
    return LLM(str(model), device=device, **{**ENGINE_ARGS, **args})


def token_ids(llm: LLM, prompt_ids, params) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]
