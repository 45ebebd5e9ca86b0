"""Edge values of request fields run as vLLM defines them instead of failing inside the step:
top_k beyond the vocabulary is off, seeds at both ends of the generator's range sample (and
n > 1 wraps its per-sample seeds back into that range), tiny temperatures sample."""

from __future__ import annotations

import pytest
from engine_helpers import assert_pool_clean, make_llm

from octavo import SamplingParams
from octavo.sampling_params import MAX_TOP_K, SEED_MAX, SEED_MIN

PROMPT = {"prompt_token_ids": [1, 17, 230, 42, 99]}


@pytest.fixture(scope="module")
def llm(tiny_model):
    return make_llm(tiny_model)


def sample(llm, **params) -> list[list[int]]:
    outputs = llm.generate(
        [PROMPT], SamplingParams(max_tokens=8, ignore_eos=True, **params), use_tqdm=False
    )
    assert_pool_clean(llm)
    return [list(completion.token_ids) for completion in outputs[0].outputs]


def test_top_k_beyond_the_vocabulary_is_off(llm):
    assert sample(llm, seed=5, top_k=MAX_TOP_K) == sample(llm, seed=5, top_k=0)
    assert sample(llm, seed=5, top_k=513) == sample(llm, seed=5, top_k=-1)


@pytest.mark.parametrize("seed", [SEED_MIN, -1, SEED_MAX])
def test_every_seed_the_generator_takes_samples_reproducibly(llm, seed):
    first = sample(llm, seed=seed)
    assert first == sample(llm, seed=seed)
    assert len(first[0]) == 8


def test_n_samples_seeded_at_the_top_of_the_range_wrap_around_to_zero(llm):
    # Sample i is seeded seed + i; past 2^64 - 1 that wraps (mod 2^64) to 0.
    both = sample(llm, seed=SEED_MAX, n=2)
    assert both == [sample(llm, seed=SEED_MAX)[0], sample(llm, seed=0)[0]]


def test_a_tiny_temperature_samples_valid_tokens(llm):
    # 1e-45 is 0 in float32; it is raised to 0.01 (vLLM's floor), so sampling stays finite.
    tokens = sample(llm, seed=0, temperature=1e-45)
    assert all(0 <= t < 512 for t in tokens[0])


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_more_samples_than_max_num_seqs_take_turns(tiny_model, llm, enable_prefix_caching):
    # The children that do not fit the running batch once the prompt is computed wait for a
    # place (they used to join it anyway, and the runner's batch overflowed: the engine died).
    small = make_llm(tiny_model, max_num_seqs=2, enable_prefix_caching=enable_prefix_caching)
    assert sample(small, seed=7, n=5) == sample(llm, seed=7, n=5)


def test_flags_that_are_not_implemented_are_refused_or_said(tiny_model):
    """A flag is implemented or refused loudly, never accepted and ignored (--no-enforce-eager:
    tests/engine/test_compiled_graph.py)."""
    from octavo.config import EngineArgs
    from octavo.errors import ConfigError

    with pytest.raises(ConfigError, match="does not split evenly over 2 nodes"):
        EngineArgs(model=str(tiny_model), tensor_parallel_size=3, nnodes=2, master_port=1234)
