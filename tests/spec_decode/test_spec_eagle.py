"""The EAGLE proposer: a head made of its one-layer target's own layer drafts what the target
would nearly always, and its drafts are the same batched, alone and in small chunks (its KV
bookkeeping follows every step), and taken in one argmax or depth by depth; a head that does not
fit the target is refused."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from spec_helpers import (
    TARGET,
    assert_pool_clean,
    eagle,
    generate,
    gumiho,
    make_llm,
    mixed_params,
    mixed_prompts,
    token_ids,
    write_self_eagle_head,
)

from octavo import SamplingParams
from octavo.errors import ConfigError
from octavo.testing.tiny_models import write_random_eagle_head, write_tiny_model

PROMPTS = mixed_prompts(12, seed=3)
PARAMS = mixed_params(len(PROMPTS), seed=3)


@pytest.fixture(scope="module")
def one_layer_target(tmp_path_factory):
    spec = dataclasses.replace(TARGET, num_hidden_layers=1, seed=11)
    return write_tiny_model(tmp_path_factory.mktemp("eagle_target") / "llama", spec)


@pytest.fixture(scope="module")
def self_head(tmp_path_factory, one_layer_target):
    return write_self_eagle_head(tmp_path_factory.mktemp("eagle_self") / "head", one_layer_target)


@pytest.fixture(scope="module")
def baseline(one_layer_target) -> list[list[int]]:
    return token_ids(generate(make_llm(one_layer_target), PROMPTS, PARAMS))


def _run(target, head, prompts=PROMPTS, params=PARAMS, **engine_args):
    llm = make_llm(target, eagle(head, 3), **engine_args)
    outputs = token_ids(generate(llm, prompts, params))
    assert_pool_clean(llm)
    scheduler = llm.engine.core.scheduler
    assert scheduler.stats.num_preempted_total > 0 or "kv_cache_memory" not in engine_args
    return outputs, scheduler.spec_stats


def test_a_head_of_the_targets_own_layer_drafts_what_the_target_would(
    one_layer_target, self_head, baseline
):
    outputs, stats = _run(one_layer_target, self_head, enable_prefix_caching=False)
    assert outputs == baseline
    assert stats.num_accepted_tokens > 0.6 * stats.num_draft_tokens


@pytest.mark.parametrize(
    "engine",
    [
        dict(max_num_batched_tokens=7),  # chunked prefill, drafts cut to the budget
        dict(block_size=1, max_num_batched_tokens=64),
        dict(kv_cache_memory=48 * 8192, max_num_batched_tokens=256),  # preemption
    ],
)
def test_its_drafts_do_not_depend_on_batching_or_chunking(
    one_layer_target, self_head, baseline, engine
):
    _, batched = _run(one_layer_target, self_head, enable_prefix_caching=False)
    outputs, stats = _run(one_layer_target, self_head, enable_prefix_caching=False, **engine)
    assert outputs == baseline
    if "kv_cache_memory" not in engine:  # a preempted request recomputes: other drafts
        assert stats.num_accepted_tokens == batched.num_accepted_tokens


def test_alone_each_request_gets_the_drafts_it_gets_in_the_batch(
    one_layer_target, self_head, baseline
):
    _, batched = _run(one_layer_target, self_head)
    accepted = 0
    for i, prompt in enumerate(PROMPTS):
        outputs, stats = _run(one_layer_target, self_head, [prompt], [PARAMS[i]])
        assert outputs == [baseline[i]]
        accepted += stats.num_accepted_tokens
    assert accepted == batched.num_accepted_tokens


def test_a_head_for_another_target_is_refused(tmp_path, one_layer_target, target_model):
    wide = dataclasses.replace(TARGET, hidden_size=32, num_attention_heads=2, seed=1)
    other = write_tiny_model(tmp_path / "other", wide)
    head = write_random_eagle_head(tmp_path / "head", other)
    with pytest.raises(ConfigError, match="speculative_config.model was made for a target with"):
        make_llm(one_layer_target, eagle(head))
    with pytest.raises(
        ConfigError, match="speculative_config.model is not a head of architecture 'EagleHead'"
    ):
        make_llm(one_layer_target, eagle(target_model))
    shutil.rmtree(head)
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ConfigError):
        make_llm(one_layer_target, eagle(tmp_path / "head"))


def _head_kv_of_verified_positions(llm, prompts, params, as_drafted=None) -> list[torch.Tensor]:
    """Per request, the head's K and V (``[2, n - 2, kv heads, head dim]``) at its positions
    0 .. n - 3 as its blocks are given up (when the runner forgets it), read through its last
    block table in the cpu platform's layout (``[2, blocks, kv heads, block size, head dim]``,
    each K tile stored transposed, ``[head dim, block size]``). Position n - 2's token after it
    came in the last step, after which nothing drafts; n - 1 has none. A request's finish
    reaches the runner with the next step, so one more request runs after them.
    ``as_drafted``: a list that gets ``(request index, K and V)`` of each drafting row's
    verified positions right after it drafted, when its drafts read them."""
    runner = llm.engine.core.runner
    proposer = runner.speculation.proposer
    cache = proposer.attention_layers[0].kv_cache
    _, num_blocks, kv_heads, block_size, head_dim = cache.shape
    k_tiles = cache[0].view(num_blocks, kv_heads, head_dim, block_size)
    where, kvs, step, forget, propose = (
        {},
        {},
        runner.execute_model,
        proposer.forget,
        proposer.propose,
    )

    def locate(batch, r, num_positions):
        positions = torch.arange(num_positions)
        table = torch.from_numpy(batch.block_table[r].astype("int64"))
        return table[positions // block_size], positions % block_size

    def read(blocks, slots):
        return torch.stack([k_tiles[blocks, :, :, slots], cache[1, blocks, :, slots]])

    def record(scheduler_output):
        output = step(scheduler_output)
        batch = runner.input_batch
        for r in range(batch.num_reqs):
            where[batch.req_ids[r]] = locate(batch, r, int(batch.num_tokens[r]) - 2)
        return output

    def read_as_forgotten(req_ids):
        forget(req_ids)
        for req_id in req_ids:
            kvs[req_id] = read(*where[req_id])

    def read_as_drafted(context):
        drafts = propose(context)
        batch = context.batch
        for r in context.rows.tolist():
            index = int(batch.req_ids[r])  # the LLM numbers its requests from 0, in order
            as_drafted.append((index, read(*locate(batch, r, int(batch.num_tokens[r]) - 1))))
        return drafts

    runner.execute_model, proposer.forget = record, read_as_forgotten
    if as_drafted is not None:
        proposer.propose = read_as_drafted
    outputs = generate(llm, prompts, params)
    proposer.propose = propose  # the one more request's drafts are not the prompts'
    generate(llm, prompts[:1], SamplingParams(max_tokens=1))
    return [kvs[o.request_id] for o in outputs]


def test_the_heads_kv_is_the_same_whether_or_not_a_step_drafted(target_model, eagle_head):
    """With disable_by_batch_size no step of a full batch drafts, so the head's KV of each
    row's verified positions is not written step by step but kept for later (here: written
    when the requests finish, in one pass): it ends up the same at every verified position
    as when every step drafts."""
    prompts = mixed_prompts(6, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    always = make_llm(target_model, eagle(eagle_head, 3), enable_prefix_caching=False)
    never = make_llm(
        target_model, eagle(eagle_head, 3, disable_by_batch_size=1), enable_prefix_caching=False
    )
    head, passes = never.engine.core.runner.speculation.proposer.model, []
    head_forward = head.forward
    head.forward = lambda *args, **kw: passes.append(1) or head_forward(*args, **kw)
    expected = _head_kv_of_verified_positions(always, prompts, params)
    got = _head_kv_of_verified_positions(never, prompts, params)
    assert len(passes) == 1  # the whole prompts, in one step, and the ten tokens, kept
    assert always.engine.core.scheduler.spec_stats.num_drafts > 0
    assert never.engine.core.scheduler.spec_stats.num_drafts == 0
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)


class TwoStepsInFive:
    """A policy that turns drafts on for two steps in five (seeded requests' always)."""

    def __init__(self) -> None:
        self.steps, self.on = 0, True

    def start_step(self, num_decodes: int) -> None:
        self.on, self.steps = self.steps % 5 < 2, self.steps + 1

    def propose_after(self, num_running: int) -> bool:
        return self.on

    def allows(self, request) -> bool:
        return self.on or request.sampling_params.seed is not None

    def observe_step(self, *args) -> None:
        pass


def test_the_heads_kv_is_the_same_when_drafts_turn_on_and_off(target_model, eagle_head):
    """Drafts on two steps in five: the positions kept while they are off are written when
    they turn on again (a seeded request drafts every step, as with the adaptive policy), so
    that each draft reads the head's KV of every position before it: at every verified
    position, as each row drafts and as it finishes, it is the same as when every step
    drafts."""
    prompts = mixed_prompts(6, seed=6)
    params = [
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, seed=i if i % 3 else None)
        for i in range(len(prompts))
    ]
    always = make_llm(target_model, eagle(eagle_head, 3), enable_prefix_caching=False)
    switching = make_llm(target_model, eagle(eagle_head, 3), enable_prefix_caching=False)
    core = switching.engine.core
    core.spec_policy = core.scheduler.spec_policy = TwoStepsInFive()
    expected = _head_kv_of_verified_positions(always, prompts, params)
    as_drafted: list = []
    got = _head_kv_of_verified_positions(switching, prompts, params, as_drafted)
    num_drafts = always.engine.core.scheduler.spec_stats.num_drafts
    assert 0 < core.scheduler.spec_stats.num_drafts < num_drafts
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
    assert len(as_drafted) > len(prompts)
    for index, kv in as_drafted:  # the last drafts read one position more than is compared
        n = min(kv.shape[1], expected[index].shape[1])
        torch.testing.assert_close(kv[:, :n], expected[index][:, :n], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("head", ["p_eagle_head", "gumiho_head"])
def test_greedy_drafts_taken_in_one_argmax_are_those_sampled_depth_by_depth(
    request, target_model, head
):
    """Where every row is greedy and no logits processor adjusts one, the drafts scored in one
    pass (P-EAGLE's, Gumiho's MLP heads') come from one argmax; a logit bias of zero sends the
    same requests through the processors and depth by depth, and must draft the same."""
    path = request.getfixturevalue(head)
    config = eagle(path, 4, parallel_drafting=True) if head == "p_eagle_head" else gumiho(path, 4)
    prompts = mixed_prompts(4, seed=2)
    runs = []
    for overrides in ({}, {"logit_bias": {0: 0.0}}):
        llm = make_llm(target_model, config)
        proposer = llm.engine.core.runner.speculation.proposer
        drafted, unprocessed = [], []

        def recorded(context, propose=proposer.propose, drafted=drafted, flags=unprocessed):
            drafts, num_drafts = propose(context)
            flags.append(context.process_logits is None)
            drafted.append([row[:n].tolist() for row, n in zip(drafts, num_drafts)])
            return drafts, num_drafts

        proposer.propose = recorded
        generate(llm, prompts, mixed_params(len(prompts), seed=2, **overrides))
        runs.append((drafted, unprocessed))
    (at_once, unprocessed), (in_order, processed) = runs
    assert unprocessed and all(unprocessed) and not any(processed)
    assert at_once == in_order
