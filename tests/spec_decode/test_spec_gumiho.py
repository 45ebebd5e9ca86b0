"""Gumiho: two serial head steps, then the MLP heads' drafts from one batched pass
(losslessness is in test_spec_lossless and test_spec_distribution); a K beyond the head's
drafts, or a head of another format, is refused."""

from __future__ import annotations

import pytest
from spec_helpers import gumiho, make_llm, mixed_params, mixed_prompts

from octavo.errors import ConfigError
from octavo.spec_decode.gumiho import GumihoHead


def test_two_serial_steps_then_one_parallel_pass_draft_k_tokens(target_model, gumiho_head):
    llm = make_llm(target_model, gumiho(gumiho_head, 5))
    proposer = llm.engine.core.runner.speculation.proposer
    assert isinstance(proposer.model, GumihoHead)
    calls = []  # per propose: the head passes it ran
    passes, parallel = proposer._chunk_pass, proposer.model.draft_in_parallel
    proposer._chunk_pass = lambda *a, **kw: calls[-1].append("pass") or passes(*a, **kw)
    proposer.model.draft_in_parallel = lambda *a: calls[-1].append(a[2]) or parallel(*a)
    at_once = proposer._greedy_at_once

    def recorded_at_once(*args, **kwargs):
        done = at_once(*args, **kwargs)
        if done is not None:  # the pass and the drafts in the platform's one call
            calls[-1].append(("one call", args[5], kwargs.get("mlp_drafts", 0)))
        return done

    proposer._greedy_at_once = recorded_at_once
    propose = proposer.propose

    def recorded_propose(context):
        calls.append([])
        try:
            return propose(context)
        finally:
            calls.append(None)  # what runs between proposals is not theirs

    proposer.propose = recorded_propose
    proposer.forward_step = _without_recording(proposer.forward_step, calls)
    prompts = mixed_prompts(4, seed=1)
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts], mixed_params(4, seed=1), use_tqdm=False
    )
    proposals = [c for c in calls if c is not None]
    assert proposals and llm.engine.core.scheduler.spec_stats.num_draft_tokens > 0
    # K = 5: the pass over the verified positions scores draft 1, one head step draft 2, and
    # drafts 3-5 come from the MLP heads at once; where the platform has a one call and the
    # step is greedy, the serial drafts (and the MLP heads' where every row drafts K) in it
    one_by_one = ["pass", "pass", 3]
    in_one_call = [[("one call", 2, 3)], [("one call", 2, 0), 3]]
    assert all(c == one_by_one or c in in_one_call for c in proposals), proposals


def _without_recording(forward_step, calls):
    def run(step, hidden_states):
        calls.append([])  # a scratch list for the passes of the step's prompt chunks
        forward_step(step, hidden_states)
        calls.pop()

    return run


def test_k_beyond_the_heads_drafts_is_refused(target_model, gumiho_head):
    with pytest.raises(ConfigError, match="drafts at most 5 tokens"):
        make_llm(target_model, gumiho(gumiho_head, 6))


def test_an_eagle_head_is_not_a_gumiho_head(target_model, eagle_head):
    with pytest.raises(ConfigError, match="is not a head of architecture 'GumihoHead'"):
        make_llm(target_model, gumiho(eagle_head, 3))
