"""Helpers the engine tests share: workloads, engines on the tiny model, the clean-pool check."""

from __future__ import annotations

import random
from pathlib import Path

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


def assert_pool_clean(llm: LLM) -> None:
    """After a workload: every block back in the pool, no request left in any queue."""
    core = llm.engine.core
    kv, scheduler = core.kv_cache_manager, core.scheduler
    assert kv.num_free_blocks == kv.block_pool.num_blocks
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks)
    assert kv.host_pool.num_free_blocks == kv.host_pool.num_blocks
    assert (
        not scheduler.requests
        and not scheduler.running
        and not scheduler.swapped
        and not len(scheduler.waiting)
    )
    assert not llm.engine.has_unfinished_requests()


def generate_ids(llm: LLM, prompts, params) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_pool_clean(llm)
    return [list(o.outputs[0].token_ids) for o in outputs]
