"""The model runner's bookkeeping: flat batch layout, persistent batch churn, preemption, swap,
copy-on-write, logprobs, seeded sampling and the profile run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_cases import PROMPTS, blocks_needed
from paged_driver import Driver

from octavo.sampling_params import SamplingParams
from octavo.sched.output import NewRequestData, SchedulerOutput

ARCH = "LlamaForCausalLM"
MAX_TOKENS = 24


@pytest.fixture
def llama(tiny_models):
    return tiny_models[ARCH]


def expected_greedy(oracle, path, max_tokens=MAX_TOKENS):
    return [oracle.greedy(path, p, max_tokens) for p in PROMPTS]


def test_flat_batch_layout(llama, make_runner):
    runner = make_runner(llama, block_size=8)
    runner.initialize_kv_cache(32)
    prompts = [list(range(100, 105)), list(range(200, 210)), list(range(300, 312))]
    params = SamplingParams(temperature=0.0)
    so = SchedulerOutput(
        [
            NewRequestData("a", prompts[0], params, [7], 0),  # whole prompt
            NewRequestData("b", prompts[1], params, [5, 9], 8),  # prefix hit: 8 cached, 2 new
            NewRequestData("c", prompts[2], params, [2], 0),  # first chunk of 5
        ],
        [],
        {"a": 5, "b": 2, "c": 5},
        12,
    )
    runner._update_states(so)
    step = runner._prepare_inputs(so)
    md = step.attn_metadata
    assert step.input_ids.tolist() == prompts[0] + prompts[1][8:] + prompts[2][:5]
    assert step.positions.tolist() == [0, 1, 2, 3, 4, 8, 9, 0, 1, 2, 3, 4]
    assert md.slot_mapping.tolist() == [56, 57, 58, 59, 60, 72, 73, 16, 17, 18, 19, 20]
    assert md.query_start_loc.tolist() == [0, 5, 7, 12]
    assert md.seq_lens.tolist() == [5, 10, 5]
    assert (
        md.block_table[0, 0] == 7
        and md.block_table[1, :2].tolist() == [5, 9]
        and md.block_table[2, 0] == 2
    )
    assert (md.max_query_len, md.max_seq_len) == (5, 10)
    assert step.sample_rows.tolist() == [0, 1]  # "c" is mid-prompt: no token
    assert step.logits_indices.tolist() == [4, 6]  # "c" samples nothing


def test_requests_joining_and_leaving_match_transformers(llama, make_runner, oracle):
    runner = make_runner(llama)
    lengths = [MAX_TOKENS, 5, 17, 9]
    driver = Driver(runner, blocks_needed(PROMPTS, MAX_TOKENS, runner.block_size))
    for prompt, arrival, max_tokens in zip(PROMPTS, [0, 3, 5, 9], lengths):
        driver.add(prompt, max_tokens, arrival=arrival)
    outputs = driver.run()
    assert outputs == [e[:n] for e, n in zip(expected_greedy(oracle, llama), lengths)]
    assert not runner.requests and runner.input_batch.num_reqs == 0


def test_idle_request_resumes_where_it_was(llama, make_runner, oracle):
    runner = make_runner(llama)
    driver = Driver(runner, blocks_needed(PROMPTS, MAX_TOKENS, runner.block_size))
    for prompt in PROMPTS:
        driver.add(prompt, MAX_TOKENS)
    for _ in range(4):
        driver.step()
    for _ in range(3):
        driver.step(skip=("req-0", "req-2"))
    assert driver.run() == expected_greedy(oracle, llama)


@pytest.mark.parametrize("chunk_size", [None, 7])
def test_preemption_by_recompute_gives_the_same_tokens(llama, make_runner, oracle, chunk_size):
    runner = make_runner(llama)
    driver = Driver(runner, blocks_needed(PROMPTS, MAX_TOKENS, runner.block_size) * 2)
    requests = [driver.add(prompt, MAX_TOKENS) for prompt in PROMPTS]
    for _ in range(10):
        driver.step(chunk_size)
    driver.preempt_recompute(requests[3])
    driver.preempt_recompute(requests[1])
    driver.step(chunk_size, skip=("req-1", "req-3"))
    assert driver.run(chunk_size) == expected_greedy(oracle, llama)


def test_preemption_by_swap_gives_the_same_tokens(llama, make_runner, oracle):
    runner = make_runner(llama)
    num_blocks = blocks_needed(PROMPTS, MAX_TOKENS, runner.block_size)
    driver = Driver(runner, num_blocks, num_host_blocks=num_blocks)
    requests = [driver.add(prompt, MAX_TOKENS) for prompt in PROMPTS]
    for _ in range(6):
        driver.step()
    swapped = list(requests[2].block_ids)
    driver.preempt_swap(requests[2])
    driver.step()  # the swap-out happens first in this step
    driver.scribble(swapped)
    driver.step()
    driver.swap_in(requests[2])
    assert driver.run() == expected_greedy(oracle, llama)


def test_copy_on_write_of_the_last_block(llama, make_runner, oracle):
    runner = make_runner(llama, block_size=8)
    driver = Driver(runner, blocks_needed(PROMPTS, MAX_TOKENS, 8) * 2)
    requests = [driver.add(prompt, MAX_TOKENS) for prompt in PROMPTS]
    for _ in range(3):
        driver.step()
    old_blocks = [driver.copy_on_write_last_block(req) for req in requests]
    driver.step()  # copies first, then writes this step's K/V into the copies
    driver.scribble(old_blocks)
    assert driver.run() == expected_greedy(oracle, llama)


def test_logprobs_match_transformers(llama, make_runner, oracle):
    runner = make_runner(llama)
    driver = Driver(runner, blocks_needed(PROMPTS, 1, runner.block_size))
    wants = [5, None, 0, 2]
    for prompt, k in zip(PROMPTS, wants):
        driver.add(prompt, 1, params=SamplingParams(temperature=0.0, logprobs=k))
    out = driver.step()
    for prompt, k, entry, tokens in zip(PROMPTS, wants, out.logprobs, out.sampled_token_ids):
        if k is None:
            assert entry is None
            continue
        expected = torch.log_softmax(oracle.last_logits(llama, prompt), dim=-1)
        top = expected.topk(k)
        assert entry.num_positions() == 1  # one row per sampled token
        (chosen, *top_ids), (chosen_logprob, *top_logprobs) = entry.token_ids[0], entry.logprobs[0]
        assert chosen == tokens[0] and list(entry.ranks) == [1]
        assert chosen_logprob == pytest.approx(expected[tokens[0]].item(), abs=1e-4)
        assert top_ids == top.indices.tolist()
        np.testing.assert_allclose(top_logprobs, top.values.tolist(), atol=1e-4)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(llama, make_runner):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)

    def sample(batch_with_others: bool) -> list[int]:
        runner = make_runner(llama)
        driver = Driver(runner, blocks_needed(PROMPTS, 16, runner.block_size))
        if batch_with_others:
            driver.add(PROMPTS[1], 16, params=SamplingParams(temperature=1.0))
            driver.add(PROMPTS[2], 16, params=SamplingParams(temperature=0.7, top_k=5, seed=7))
        target = driver.add(PROMPTS[3], 16, params=seeded)
        driver.run()
        return target.output

    alone = sample(False)
    assert alone == sample(True)
    assert len(set(alone)) > 1


def test_top_k_1_samples_the_greedy_tokens(llama, make_runner, oracle):
    runner = make_runner(llama)
    driver = Driver(runner, blocks_needed(PROMPTS, MAX_TOKENS, runner.block_size))
    for prompt in PROMPTS:
        driver.add(prompt, MAX_TOKENS, params=SamplingParams(temperature=0.8, top_k=1))
    assert driver.run() == expected_greedy(oracle, llama)


def test_profile_run_measures_activations_and_leaves_nothing_behind(llama, make_runner, oracle):
    runner = make_runner(llama, max_num_seqs=4, max_num_batched_tokens=256)
    result = runner.profile_run()
    config = runner.model_config
    logits_bytes = result.num_reqs * config.vocab_size * 4
    hidden_bytes = result.num_tokens * config.intermediate_size * 2 * 4  # the gate/up output
    assert (result.num_tokens, result.num_reqs) == (256, 4)
    assert max(logits_bytes, hidden_bytes) <= result.peak_activation_bytes < 64 * hidden_bytes
    assert not runner.requests and runner.input_batch.num_reqs == 0
    assert all(layer.kv_cache is None for layer in runner.attention_layers)
    driver = Driver(runner, blocks_needed(PROMPTS, MAX_TOKENS, runner.block_size))
    for prompt in PROMPTS:
        driver.add(prompt, MAX_TOKENS)
    assert driver.run() == expected_greedy(oracle, llama)


def test_host_kv_caches_are_zero_until_written_and_cost_no_start_up(llama, make_runner):
    """The cpu KV cache comes from anonymous memory: zero without writing a page at start-up."""
    from octavo.model_executor.memory import zeros_on_touch

    runner = make_runner(llama)
    runner.initialize_kv_cache(num_blocks=64, num_host_blocks=8)
    for cache in runner.kv_caches + runner.host_kv_caches:
        assert cache.is_contiguous() and cache.dtype == runner.model_config.dtype
        assert not cache.any()
    assert runner.host_kv_caches[0].shape[2:] == runner.kv_caches[0].shape[2:]
    big = zeros_on_touch((2, 1 << 20, 1024), torch.float32, "cpu")  # 8 GiB, never touched whole
    big[1, 12345].fill_(2.0)
    assert big[1, 12345].sum() == 2048.0 and big[0, 12345].sum() == 0 and big[1, -1].sum() == 0
