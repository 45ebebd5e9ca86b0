"""Helpers the engine tests share: workloads, engines on the tiny model, the clean-pool check."""

from __future__ import annotations

import random
from pathlib import Path

from pool_checks import assert_pool_clean  # noqa: F401  (shared with tests/spec_decode)

from octavo import LLM


def shared_prefix_prompts(num: int, seed: int = 0, vocab_size: int = 512) -> list[list[int]]:
    """``num`` prompts in four families sharing 0-40-token prefixes, 3-60 own tokens each."""
    rng = random.Random(seed)
    prefixes = [[1] + [rng.randrange(3, vocab_size) for _ in range(n)] for n in (0, 17, 33, 40)]
    return [
        prefixes[i % 4] + [rng.randrange(3, vocab_size) for _ in range(rng.randrange(3, 60))]
        for i in range(num)
    ]


def make_llm(model: Path, **engine_args) -> LLM:
    engine_args.setdefault("kv_cache_memory", "8MiB")
    engine_args.setdefault("max_num_seqs", 64)
    engine_args.setdefault("max_num_batched_tokens", 512)
    return LLM(str(model), **engine_args)


def generate_ids(llm: LLM, prompts, params) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_pool_clean(llm)
    return [list(o.outputs[0].token_ids) for o in outputs]
