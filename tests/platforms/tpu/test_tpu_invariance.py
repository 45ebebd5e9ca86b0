"""The engine invariance tests on the tpu runner: a request's greedy tokens are the same alone
or batched, with and without prefix caching, at any chunked-prefill budget, and when it is
preempted (recompute or swap), and equal the cpu platform's."""

from __future__ import annotations

import pytest
from tpu_cases import engine, token_ids, write_model

from octavo import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
NUM_REQUESTS = 16


def shared_prefix_prompts(num: int) -> list[list[int]]:
    """Four families sharing 0-33-token prefixes, 3-40 own tokens each."""
    import random

    rng = random.Random(5)
    prefixes = [[1] + [rng.randrange(3, 512) for _ in range(n)] for n in (0, 9, 17, 33)]
    return [
        prefixes[i % 4] + [rng.randrange(3, 512) for _ in range(rng.randrange(3, 40))]
        for i in range(num)
    ]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("tpu_invariance"), "llama")


@pytest.fixture(scope="module")
def prompts():
    return shared_prefix_prompts(NUM_REQUESTS)


@pytest.fixture(scope="module")
def alone(model, prompts) -> list[list[int]]:
    llm = engine(model, "tpu", enable_prefix_caching=False)
    return [token_ids(llm, [p], GREEDY)[0] for p in prompts]


def test_alone_tokens_equal_the_cpu_platforms(model, prompts, alone):
    cpu = engine(model, "cpu", enable_prefix_caching=False)
    assert token_ids(cpu, prompts, GREEDY) == alone


@pytest.mark.parametrize(
    "args",
    [
        dict(enable_prefix_caching=True, max_num_batched_tokens=16),
        dict(enable_prefix_caching=True, max_num_batched_tokens=64),
        dict(enable_prefix_caching=False, max_num_batched_tokens=64),
    ],
    ids=["cache-16", "cache-64", "nocache-64"],
)
def test_batched_requests_match_their_alone_runs(model, prompts, alone, args):
    llm = engine(model, "tpu", max_num_seqs=16, **args)
    assert token_ids(llm, prompts, GREEDY) == alone
    if args["enable_prefix_caching"]:
        assert llm.engine.core.kv_cache_manager.prefix_cache_hits > 0


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preempted_requests_finish_with_their_alone_tokens(model, prompts, alone, preemption_mode):
    # the tiny Llama: 2 layers x 2 KV heads x 16 dims in float32 -> 8 KiB per 16-token block;
    # 12 blocks hold about 3 of the 16 requests at once (a request may be 128 tokens long)
    llm = engine(
        model,
        "tpu",
        max_num_seqs=16,
        kv_cache_memory=12 * 8192,
        preemption_mode=preemption_mode,
        swap_space=0.01,
        max_num_batched_tokens=64,
        max_model_len=128,
    )
    assert llm.engine.core.kv_cache_manager.block_pool.num_blocks == 12
    assert token_ids(llm, prompts, GREEDY) == alone
    stats = llm.engine.core.scheduler.stats
    assert stats.num_preempted_total > 3
    if preemption_mode == "swap":
        assert stats.num_swapped_out_total > 3
