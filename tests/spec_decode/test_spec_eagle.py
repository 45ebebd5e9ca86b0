"""The EAGLE proposer: a head made of its one-layer target's own layer drafts what the target
would nearly always, and its drafts are the same batched, alone and in small chunks (its KV
bookkeeping follows every step), and taken in one argmax or depth by depth; a head that does not
fit the target is refused."""

from __future__ import annotations

import contextlib
import copy
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


def _kv_reader(llm):
    """``(locate, read)``: ``locate(batch, row, n)`` the blocks and slots of the row's positions
    0 .. n - 1, ``read(blocks, slots)`` the head's K and V there (``[2, n, kv heads, head
    dim]``), in the cpu platform's layout (``[2, blocks, kv heads, block size, head dim]``,
    each K tile stored transposed, ``[head dim, block size]``)."""
    cache = llm.engine.core.runner.speculation.proposer.attention_layers[0].kv_cache
    _, num_blocks, kv_heads, block_size, head_dim = cache.shape
    k_tiles = cache[0].view(num_blocks, kv_heads, head_dim, block_size)

    def locate(batch, r, num_positions):
        positions = torch.arange(num_positions)
        table = torch.from_numpy(batch.block_table[r].astype("int64"))
        return table[positions // block_size], positions % block_size

    def read(blocks, slots):
        return torch.stack([k_tiles[blocks, :, :, slots], cache[1, blocks, :, slots]])

    return locate, read


def _head_kv_of_verified_positions(llm, prompts, params, as_drafted=None) -> list[torch.Tensor]:
    """Per request, the head's K and V at its positions 0 .. n - 3 as its blocks are given up
    (when the runner forgets it): position n - 2's token after it came in the last step, after
    which nothing drafts; n - 1 has none. Meant for a run whose every step drafts (nothing is
    kept past a request's finish). A request's finish reaches the runner with the next step, so
    one more request runs after them. ``as_drafted``: a list that gets ``(request index, K and
    V)`` of each drafting row's verified positions right after it drafted, when its drafts read
    them."""
    runner = llm.engine.core.runner
    proposer = runner.speculation.proposer
    locate, read = _kv_reader(llm)
    where, kvs, step, forget = {}, {}, runner.execute_model, proposer.forget

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

    runner.execute_model, proposer.forget = record, read_as_forgotten
    with _drafts_reading(llm, as_drafted):
        outputs = generate(llm, prompts, params)
    generate(llm, prompts[:1], SamplingParams(max_tokens=1))
    runner.execute_model, proposer.forget = step, forget
    return [kvs[o.request_id] for o in outputs]


@contextlib.contextmanager
def _drafts_reading(llm, as_drafted):
    """In the block, ``as_drafted`` (unless None) gets ``(request index, K and V)`` of each
    drafting row's verified positions right after it drafted, when its drafts read them."""
    proposer = llm.engine.core.runner.speculation.proposer
    locate, read = _kv_reader(llm)
    propose = proposer.propose

    def read_as_drafted(context):
        drafts = propose(context)
        batch = context.batch
        for r in context.rows.tolist():
            index = int(batch.req_ids[r])  # the LLM numbers its requests from 0, in order
            as_drafted.append((index, read(*locate(batch, r, int(batch.num_tokens[r]) - 1))))
        return drafts

    if as_drafted is not None:
        proposer.propose = read_as_drafted
    try:
        yield
    finally:
        proposer.propose = propose


def _head_kv_read_again(
    llm, prompts, params, between=lambda: None, as_drafted=None
) -> list[torch.Tensor]:
    """Per request, the head's K and V at the positions a second request reads from the prefix
    cache when its prompt is the first one's tokens (prompt and output): those before the
    second request's first computed position, read through the second one's block table right
    after its first step (a block the first one computed may not be the one read: blocks of the
    same tokens are cached once). One more request runs between (the finish of the first ones
    reaches the runner), then ``between()``. ``as_drafted``: as above, for the first
    requests."""
    runner = llm.engine.core.runner
    locate, read = _kv_reader(llm)
    kvs, step = {}, runner.execute_model
    base = int(next(copy.copy(llm.engine._ids)))  # the LLM numbers its requests in order
    second = base + len(prompts) + 1  # the first second request's id

    def record(scheduler_output):
        output = step(scheduler_output)
        batch = runner.input_batch
        for r in range(batch.num_reqs):
            req_id = batch.req_ids[r]
            if int(req_id) >= second and req_id not in kvs:  # a second request's first step
                first = int(batch.num_computed_tokens[r])
                first -= scheduler_output.num_scheduled_tokens[req_id]
                kvs[req_id] = read(*locate(batch, r, first))
        return output

    with _drafts_reading(llm, as_drafted):
        outputs = generate(llm, prompts, params)
    generate(llm, [[1, 2, 3]], SamplingParams(max_tokens=1))
    between()
    again = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs)]
    runner.execute_model = record
    rereads = generate(llm, again, SamplingParams(max_tokens=1))
    runner.execute_model = step
    return [kvs[r.request_id] for r in rereads]


def test_the_heads_kv_is_the_same_whether_or_not_a_step_drafted(target_model, eagle_head):
    """With disable_by_batch_size no step of a full batch drafts, so the head's KV of each
    row's verified positions is not written step by step but kept; when the requests finish
    nothing is written either (most blocks are never read again), until a request reads their
    blocks from the prefix cache: then, before its first head pass, the positions there get the
    same KV as when every step drafts."""
    prompts = mixed_prompts(6, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    always = make_llm(target_model, eagle(eagle_head, 3), block_size=8)
    never = make_llm(target_model, eagle(eagle_head, 3, disable_by_batch_size=1), block_size=8)
    head, passes = never.engine.core.runner.speculation.proposer.model, []
    head_forward = head.forward
    head.forward = lambda *args, **kw: passes.append(1) or head_forward(*args, **kw)
    expected = _head_kv_of_verified_positions(always, prompts, params)
    at_finish: list = []
    got = _head_kv_read_again(never, prompts, params, lambda: at_finish.append(len(passes)))
    assert at_finish == [0]  # every position kept, nothing written as the requests finished
    assert len(passes) == 1  # the second requests' hits: one pass before their first step's
    assert always.engine.core.scheduler.spec_stats.num_drafts > 0
    assert never.engine.core.scheduler.spec_stats.num_drafts == 0
    compared = 0
    for e, g, prompt in zip(expected, got, prompts):
        torch.testing.assert_close(g, e[:, : g.shape[1]], atol=1e-4, rtol=1e-4)
        compared += max(g.shape[1] - len(prompt), 0)
    assert compared > 24  # generated positions among them, not only the prompts'


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
    that each draft reads the head's KV of every position before it; those kept when a request
    finishes are written when another reads its blocks from the prefix cache. At every
    verified position, as each row drafts and as it is read again, the KV is the same as when
    every step drafts."""
    prompts = mixed_prompts(6, seed=6)
    params = [
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, seed=i if i % 3 else None)
        for i in range(len(prompts))
    ]
    always = make_llm(target_model, eagle(eagle_head, 3), block_size=8)
    switching = make_llm(target_model, eagle(eagle_head, 3), block_size=8)
    core = switching.engine.core
    core.spec_policy = core.scheduler.spec_policy = TwoStepsInFive()
    expected = _head_kv_of_verified_positions(always, prompts, params)
    num_drafts = always.engine.core.scheduler.spec_stats.num_drafts
    as_drafted: list = []
    got = _head_kv_read_again(switching, prompts, params, as_drafted=as_drafted)
    assert 0 < core.scheduler.spec_stats.num_drafts < num_drafts
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e[:, : g.shape[1]], atol=1e-4, rtol=1e-4)
    assert sum(g.shape[1] for g in got) > sum(map(len, prompts))
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


def test_a_finished_requests_blocks_held_by_a_running_one_are_found():
    """Its kept positions are then written at once (the running request reads them from its
    next draft on); block ids past a row's own blocks are stale and do not count."""
    import types

    import numpy as np

    from octavo.spec_decode.eagle import EagleProposer

    batch = types.SimpleNamespace(
        num_reqs=3,
        block_table=np.array([[1, 2, 3], [4, 5, 9], [2, 6, 9]], dtype=np.int32),
        num_blocks=np.array([3, 2, 2]),
    )
    kept = {0: [], 1: []}  # rows 0 and 1 finish; row 2 runs on
    assert EagleProposer._shared_rows(batch, kept) == {0}  # block 2; block 9 is stale in row 1
    assert EagleProposer._shared_rows(batch, {1: []}) == set()  # 9 is stale in rows 1 and 2
    assert EagleProposer._shared_rows(batch, {0: [], 1: [], 2: []}) == set()


def test_a_block_computed_again_drops_what_a_finished_request_left_there(target_model, eagle_head):
    """A finished request's kept positions wait by block. When a block is reused, a long
    prompt's early chunk (not sampled, so its head KV is written at once) computes it again:
    what was left there goes, and a request that later reads the block from the prefix cache
    finds the new tokens' KV, the same as when every step drafts."""
    # 3 to 14 chunks of 16 tokens, some sharing a prefix of up to 34 tokens with another
    prompts = [p * 3 for p in mixed_prompts(12, seed=8)]
    first, second = prompts[:6], prompts[6:]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # 160 blocks of 8 tokens (6 KiB each for this target and head): the second requests reuse
    # some of the first ones'
    sizes = dict(block_size=8, max_num_batched_tokens=16, kv_cache_memory="960KiB")
    always = make_llm(target_model, eagle(eagle_head, 3), **sizes)
    never = make_llm(target_model, eagle(eagle_head, 3, disable_by_batch_size=1), **sizes)
    assert never.engine.core.kv_cache_manager.block_pool.num_blocks == 160
    expected = _head_kv_of_verified_positions(always, second, params)
    pending = never.engine.core.runner.speculation.proposer._pending
    generate(never, first, params)
    generate(never, [[1, 2, 3]], SamplingParams(max_tokens=1))  # their finish reaches the runner
    left = set(pending._blocks)
    got = _head_kv_read_again(never, second, params)
    assert left - set(pending._blocks)  # blocks computed again: what was left there went
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e[:, : g.shape[1]], atol=1e-4, rtol=1e-4)
