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
    for name in ("_head_step", "model.draft_in_parallel"):
        owner = proposer.model if name.startswith("model.") else proposer
        attr = name.split(".")[-1]
        original = getattr(owner, attr)
        setattr(owner, attr, _recording(original, attr, calls))
    propose = proposer.propose
    proposer.propose = lambda context: calls.append([]) or propose(context)
    prompts = mixed_prompts(4, seed=1)
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts], mixed_params(4, seed=1), use_tqdm=False
    )
    proposals = [c for c in calls if c and c[0] != "setup"]
    assert proposals and llm.engine.core.scheduler.spec_stats.num_draft_tokens > 0
    # K = 5: two serial head steps, then drafts 3-5 from the MLP heads in one pass
    assert all(c == ["_head_step", "_head_step", ("draft_in_parallel", 3)] for c in proposals)


def _recording(original, name, calls):
    def record(*args):
        if not calls:
            calls.append(["setup"])
        calls[-1].append((name, args[2]) if name == "draft_in_parallel" else name)
        return original(*args)

    return record


def test_k_beyond_the_heads_drafts_is_refused(target_model, gumiho_head):
    with pytest.raises(ConfigError, match="drafts at most 5 tokens"):
        make_llm(target_model, gumiho(gumiho_head, 6))


def test_an_eagle_head_is_not_a_gumiho_head(target_model, eagle_head):
    with pytest.raises(ConfigError, match="is not a head of architecture 'GumihoHead'"):
        make_llm(target_model, gumiho(eagle_head, 3))
