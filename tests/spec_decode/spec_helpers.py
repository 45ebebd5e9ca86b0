"""Workloads and engines the speculative-decoding tests share."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Optional

from pool_checks import assert_pool_clean  # noqa: F401  (re-exported for the tests here)

from octavo import LLM, SamplingParams
from octavo.testing.tiny_models import TinyModelSpec

TARGET = TinyModelSpec(
    "LlamaForCausalLM",
    hidden_size=64,
    num_hidden_layers=2,
    vocab_size=512,
    max_position_embeddings=640,
    seed=7,
)
DRAFT = TinyModelSpec(
    "LlamaForCausalLM",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=512,
    max_position_embeddings=640,
    seed=8,
)


def mixed_prompts(num: int = 36, seed: int = 0, vocab_size: int = 512) -> list[list[int]]:
    """Two thirds random prompts in families sharing 0-40-token prefixes, one third repetitive
    ones (a phrase repeated with changes) where n-gram lookup finds long matches."""
    rng = random.Random(seed)
    prefixes = [[1] + [rng.randrange(3, vocab_size) for _ in range(n)] for n in (0, 17, 33, 40)]
    prompts = []
    for i in range(num):
        if i % 3 == 2:
            phrase = [rng.randrange(3, vocab_size) for _ in range(rng.randrange(3, 9))]
            prompt = []
            for _ in range(rng.randrange(3, 6)):
                copy = list(phrase)
                copy[rng.randrange(len(copy))] = rng.randrange(3, vocab_size)
                prompt += copy
        else:
            prompt = prefixes[i % 4] + [
                rng.randrange(3, vocab_size) for _ in range(rng.randrange(3, 50))
            ]
        prompts.append(prompt)
    return prompts


def mixed_params(num: int, seed: int = 0, **overrides) -> list[SamplingParams]:
    """Greedy params with 8-40 new tokens, half ignoring EOS."""
    rng = random.Random(seed)
    return [
        SamplingParams(
            **{
                "temperature": 0.0,
                "max_tokens": rng.randrange(8, 41),
                "ignore_eos": bool(i % 2),
                **overrides,
            }
        )
        for i in range(num)
    ]


def make_llm(model: Path, speculative_config: Optional[dict] = None, **engine_args) -> LLM:
    engine_args.setdefault("kv_cache_memory", "8MiB")
    engine_args.setdefault("max_num_seqs", 64)
    engine_args.setdefault("max_num_batched_tokens", 512)
    return LLM(str(model), speculative_config=speculative_config, **engine_args)


def generate(llm: LLM, prompts, params) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


# The tests schedule every draft (adaptive off): what the adaptive policy lets through depends
# on the machine's step times, and the tests must not. test_spec_policy covers the policy.
def ngram(k: int = 4, **extra) -> dict:
    lookup = {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
    return {"method": "ngram", "num_speculative_tokens": k, **lookup, "adaptive": False, **extra}


def draft(path: Path, k: int = 3, **extra) -> dict:
    return {
        "method": "draft_model",
        "model": str(path),
        "num_speculative_tokens": k,
        "adaptive": False,
        **extra,
    }


def eagle(path: Path, k: int = 3, **extra) -> dict:
    return {
        "method": "eagle",
        "model": str(path),
        "num_speculative_tokens": k,
        "adaptive": False,
        **extra,
    }


def gumiho(path: Path, k: int = 4) -> dict:
    return {**eagle(path, k), "method": "gumiho"}


def mtp(k: int = 3, **extra) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, "adaptive": False, **extra}


def write_self_eagle_head(folder: Path, target: Path) -> Path:
    """An EAGLE head that is its one-layer target's own layer (``fc`` passes the token's
    embedding through, the target's final norm): at position p it computes the target's hidden
    state for the token at p + 1 from every token but the first, so it drafts what the target
    would, nearly always. Drafts that follow it show the head's KV bookkeeping is right."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from octavo.spec_decode.eagle_head import head_config

    folder.mkdir(parents=True, exist_ok=True)
    config = head_config(json.loads((target / "config.json").read_text()))
    (folder / "config.json").write_text(json.dumps(config))
    weights = load_file(str(target / "model.safetensors"))
    head = {
        name[len("model.") :]: tensor
        for name, tensor in weights.items()
        if name.startswith("model.layers.0.") or name == "model.norm.weight"
    }
    hidden = config["hidden_size"]
    head["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    save_file(head, str(folder / "model.safetensors"))
    return folder
