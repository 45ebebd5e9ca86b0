"""P-EAGLE (eagle with parallel_drafting): one head pass drafts all K tokens (losslessness is in
test_spec_lossless and test_spec_distribution); a head without the mask inputs, or the flag on
another method, is refused."""

from __future__ import annotations

import pytest
from spec_helpers import eagle, make_llm, mixed_params, mixed_prompts, ngram

from octavo.errors import ConfigError
from octavo.spec_decode.p_eagle import ParallelEagleHead


def test_one_head_pass_drafts_every_token(target_model, p_eagle_head):
    llm = make_llm(target_model, eagle(p_eagle_head, 4, parallel_drafting=True))
    proposer = llm.engine.core.runner.speculation.proposer
    assert isinstance(proposer.model, ParallelEagleHead)
    calls, at_once = [], []
    forward = proposer.model.forward
    proposer.model.forward = lambda *a, **kw: calls.append(kw.get("masked")) or forward(*a, **kw)
    greedy_at_once = proposer._greedy_at_once

    def recorded_at_once(*args, **kwargs):
        done = greedy_at_once(*args, **kwargs)
        if done is not None:  # the pass and its drafts in the platform's one call
            at_once.append((args[5], kwargs.get("parallel")))  # (steps, parallel)
        return done

    proposer._greedy_at_once = recorded_at_once
    prompts = mixed_prompts(4, seed=1)
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts], mixed_params(4, seed=1), use_tqdm=False
    )
    drafting = [m for m in calls if m is not None]
    assert any(m.any() for m in drafting) or at_once, "no parallel drafting pass ran"
    # each pass: per row one known position and up to K - 1 masked ones
    assert all(0 < int(m.sum()) <= 3 * len(prompts) for m in drafting if m.any())
    assert all(steps_parallel == (4, True) for steps_parallel in at_once)
    assert llm.engine.core.scheduler.spec_stats.num_draft_tokens > 0


def test_a_head_without_mask_inputs_is_refused(target_model, eagle_head):
    with pytest.raises(ConfigError, match="parallel_drafting needs a head trained"):
        make_llm(target_model, eagle(eagle_head, 3, parallel_drafting=True))


def test_parallel_drafting_is_for_eagle_only(target_model):
    with pytest.raises(ConfigError, match="parallel_drafting is for method 'eagle'"):
        make_llm(target_model, {**ngram(3), "parallel_drafting": True})
