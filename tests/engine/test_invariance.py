"""Invariance: a request's greedy tokens do not depend on what it is batched with, on prefix
caching, on the chunked-prefill budget, on being preempted (recompute or swap), or on the
model being split over two tensor-parallel ranks (the oracle always runs on one)."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import generate_ids, make_llm, shared_prefix_prompts

from octavo import SamplingParams
from octavo.platform.facade import Platform

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
NUM_REQUESTS = 64


def skip_tp_off_the_host(tp: int) -> None:
    """TP = 2 runs here on the cpu platform's two ranks; a device platform needs two devices."""
    if tp > 1 and Platform.select(None).name != "cpu" and torch.cuda.device_count() < tp:
        pytest.skip(f"tensor parallelism over {tp} ranks needs {tp} devices")


@pytest.fixture(scope="module")
def prompts():
    return shared_prefix_prompts(NUM_REQUESTS, seed=3)


@pytest.fixture(scope="module")
def alone(tiny_model, prompts) -> list[list[int]]:
    """Each request run by itself, in an engine with nothing else to do."""
    llm = make_llm(tiny_model, enable_prefix_caching=False)
    return [generate_ids(llm, [p], GREEDY)[0] for p in prompts]


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(enable_prefix_caching=True, max_num_batched_tokens=16),
        dict(enable_prefix_caching=True, max_num_batched_tokens=64),
        dict(enable_prefix_caching=True, max_num_batched_tokens=2048),
        dict(enable_prefix_caching=False, max_num_batched_tokens=64),
        dict(
            enable_prefix_caching=False, max_num_batched_tokens=2048, enable_chunked_prefill=False
        ),
        dict(enable_prefix_caching=True, block_size=1, max_num_batched_tokens=64),
    ],
    ids=["cache-16", "cache-64", "cache-2048", "nocache-64", "nocache-nochunk", "cache-bs1"],
)
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["tp1", "tp2"])
def test_batched_requests_match_their_alone_runs(tiny_model, prompts, alone, engine_args, tp):
    skip_tp_off_the_host(tp)
    # kv_cache_memory is per rank: a rank holding half the KV heads gets half the bytes
    llm = make_llm(
        tiny_model, tensor_parallel_size=tp, kv_cache_memory=(8 << 20) // tp, **engine_args
    )
    assert generate_ids(llm, prompts, GREEDY) == alone
    if engine_args["enable_prefix_caching"]:
        assert llm.engine.core.kv_cache_manager.prefix_cache_hits > 0


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["tp1", "tp2"])
def test_preempted_requests_finish_with_their_alone_tokens(
    tiny_model, prompts, alone, preemption_mode, enable_prefix_caching, tp
):
    skip_tp_off_the_host(tp)
    # 24 blocks of 16 tokens: room for about 5 of the 64 requests at once.
    llm = make_llm(
        tiny_model,
        tensor_parallel_size=tp,
        kv_cache_memory=24 * 8192 // tp,
        preemption_mode=preemption_mode,
        swap_space=0.01 / tp,
        enable_prefix_caching=enable_prefix_caching,
        max_num_batched_tokens=256,
    )
    assert llm.engine.core.kv_cache_manager.block_pool.num_blocks == 24
    assert generate_ids(llm, prompts, GREEDY) == alone
    stats = llm.engine.core.scheduler.stats
    assert stats.num_preempted_total > 10
    if preemption_mode == "swap":
        assert stats.num_swapped_out_total > 10


def test_decodes_sharing_a_long_prefix_match_their_alone_runs(tiny_model):
    """Ten requests behind one 150-token prefix, cached once: their decodes attend its first
    whole 64-token groups together (the cpu kernel's cascade attention, from eight decodes on);
    each request's tokens are still those of its run alone without caching."""
    rng = random.Random(5)
    prefix = [1] + [rng.randrange(3, 512) for _ in range(150)]
    prompts = [
        prefix + [rng.randrange(3, 512) for _ in range(rng.randrange(3, 20))] for _ in range(10)
    ]
    apart = make_llm(tiny_model, enable_prefix_caching=False)
    alone = [generate_ids(apart, [p], GREEDY)[0] for p in prompts]
    llm = make_llm(tiny_model, enable_prefix_caching=True)
    assert generate_ids(llm, prompts, GREEDY) == alone
    assert llm.engine.core.kv_cache_manager.prefix_cache_hits > 0


def test_stories260k_invariance_under_batching_and_preemption(stories260k_path):
    tokenizer_llm = make_llm(stories260k_path, enable_prefix_caching=False)
    texts = ["Once upon a time", "The little dog", "Lily wanted to", "One day, a boy named Tim"] * 4
    prompts = [tokenizer_llm.get_tokenizer().encode(t) + [i + 3] for i, t in enumerate(texts)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    alone = [generate_ids(tokenizer_llm, [p], params)[0] for p in prompts]
    for mode in ("recompute", "swap"):
        # stories260K: 5 layers x 4 kv heads x 8 dims -> 20 KiB per 16-token block; 40 blocks.
        llm = make_llm(
            stories260k_path,
            kv_cache_memory=40 * 20480,
            preemption_mode=mode,
            swap_space=0.01,
            max_num_batched_tokens=64,
        )
        assert generate_ids(llm, prompts, params) == alone
        assert llm.engine.core.scheduler.stats.num_preempted_total > 0
