"""Fixtures for engine tests: a tiny random Llama, engines on it, and the clean-pool check."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from octavo import LLM
from octavo.testing.tiny_models import TinyModelSpec, write_tiny_model

TINY = TinyModelSpec("LlamaForCausalLM", hidden_size=64, num_hidden_layers=2, vocab_size=512, max_position_embeddings=256, seed=7)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny shapes gain nothing from a second thread on a shared 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("engine_tiny") / "llama", TINY)


def shared_prefix_prompts(num: int, seed: int = 0, vocab_size: int = 512) -> list[list[int]]:
    """``num`` prompts in four families sharing 0-40-token prefixes, 3-60 own tokens each."""
    rng = random.Random(seed)
    prefixes = [[1] + [rng.randrange(3, vocab_size) for _ in range(n)] for n in (0, 17, 33, 40)]
    return [prefixes[i % 4] + [rng.randrange(3, vocab_size) for _ in range(rng.randrange(3, 60))] for i in range(num)]


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
    assert not scheduler.requests and not scheduler.running and not scheduler.swapped and not len(scheduler.waiting)
    assert not llm.engine.has_unfinished_requests()


def generate_ids(llm: LLM, prompts, params) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_pool_clean(llm)
    return [list(o.outputs[0].token_ids) for o in outputs]
