"""Lossless greedy speculation: with n-gram or draft-model drafts, every request gets exactly the
tokens of decoding without speculation — batched, with prefix caching, with chunked prefill at
small budgets, under heavy preemption (recompute and swap) — and every block is free after."""

from __future__ import annotations

import re

import pytest
from spec_helpers import (
    assert_pool_clean,
    draft,
    eagle,
    generate,
    gumiho,
    make_llm,
    mixed_params,
    mixed_prompts,
    mtp,
    ngram,
    token_ids,
)

from octavo import SamplingParams

PROMPTS = mixed_prompts(36, seed=3)
PARAMS = mixed_params(len(PROMPTS), seed=3)

ENGINES = {
    "batched": dict(enable_prefix_caching=False),
    "prefix-cache-chunk16": dict(enable_prefix_caching=True, max_num_batched_tokens=16),
    "chunk-7": dict(enable_prefix_caching=True, max_num_batched_tokens=7),
    "recompute": dict(kv_cache_memory=48 * 8192, max_num_batched_tokens=256),
    "swap": dict(
        kv_cache_memory=48 * 8192,
        max_num_batched_tokens=256,
        preemption_mode="swap",
        swap_space=0.02,
    ),
    "block-1": dict(block_size=1, max_num_batched_tokens=64),
}


@pytest.fixture(scope="module")
def baseline(target_model) -> list[list[int]]:
    return token_ids(generate(make_llm(target_model), PROMPTS, PARAMS))


@pytest.fixture(
    scope="module",
    params=[
        "ngram",
        "draft-model",
        "self-draft",
        "eagle",
        "p-eagle",
        "p-eagle-2-layers",
        "gumiho",
        "mtp",
    ],
)
def spec(
    request,
    target_model,
    draft_model,
    eagle_head,
    p_eagle_head,
    two_layer_p_eagle_head,
    gumiho_head,
) -> tuple[str, dict]:
    """The proposer: n-gram, a smaller random draft (mostly rejected), the target itself as its
    own draft (mostly accepted), a random EAGLE head, random P-EAGLE heads of one and two
    layers, a random Gumiho head (K = 4: two serial drafts, two parallel), the target's random
    MTP layer (the heads' drafts mostly rejected)."""
    name = request.param
    if name == "ngram":
        return name, ngram(4)
    if name == "eagle":
        return name, eagle(eagle_head, 3)
    if name == "p-eagle":
        return name, eagle(p_eagle_head, 3, parallel_drafting=True)
    if name == "p-eagle-2-layers":
        return name, eagle(two_layer_p_eagle_head, 3, parallel_drafting=True)
    if name == "gumiho":
        return name, gumiho(gumiho_head, 4)
    if name == "mtp":
        return name, mtp(3)
    return name, draft(draft_model if name == "draft-model" else target_model, 3)


@pytest.mark.parametrize("method", ["ngram", "draft-model"])
def test_the_adaptive_policy_changes_speed_only(target_model, draft_model, baseline, method):
    """With the adaptive policy on (the default), whichever drafts it lets through, the tokens
    are those of plain decoding."""
    config = ngram(4) if method == "ngram" else draft(draft_model, 3)
    llm = make_llm(target_model, {**config, "adaptive": True}, max_num_batched_tokens=64)
    assert llm.engine.core.spec_policy is not None
    assert token_ids(generate(llm, PROMPTS, PARAMS)) == baseline
    assert_pool_clean(llm)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_speculation_gives_the_tokens_of_plain_decoding(target_model, baseline, spec, engine):
    name, config = spec
    engine_args = dict(ENGINES[engine])
    if name != "ngram" and "kv_cache_memory" in engine_args:
        engine_args["kv_cache_memory"] *= 2  # the draft's KV shares each block
    llm = make_llm(target_model, config, **engine_args)
    assert token_ids(generate(llm, PROMPTS, PARAMS)) == baseline
    assert_pool_clean(llm)
    stats = llm.engine.core.scheduler.spec_stats
    assert stats.num_draft_tokens > 0
    if name in ("ngram", "self-draft"):  # the others are random: mostly rejected
        assert stats.num_accepted_tokens > 0.1 * stats.num_draft_tokens
    if engine in ("recompute", "swap"):
        scheduler_stats = llm.engine.core.scheduler.stats
        assert scheduler_stats.num_preempted_total > 0
        if engine == "swap":
            assert scheduler_stats.num_swapped_out_total > 0


def test_stops_and_max_tokens_cut_accepted_drafts_as_without_speculation(target_model):
    """A stop token or string inside accepted drafts ends the output there; max_tokens holds."""
    plain = make_llm(target_model)
    spec = make_llm(target_model, ngram(5))
    free = token_ids(generate(plain, PROMPTS, mixed_params(len(PROMPTS), ignore_eos=True)))
    # For each request, a token from the middle of its free-running output becomes its stop.
    params = []
    for i, tokens in enumerate(free):
        stop = {"stop_token_ids": [tokens[len(tokens) // 2]]} if i % 2 else {}
        if i % 3 == 0:
            text = plain.get_tokenizer().decode(tokens[len(tokens) // 3 : len(tokens) // 3 + 2])
            stop["stop"] = [text] if text.strip() else None
        params.append(SamplingParams(temperature=0.0, max_tokens=5 + i, **stop))
    expected, got = generate(plain, PROMPTS, params), generate(spec, PROMPTS, params)
    for e, g, p in zip(expected, got, params):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert g.outputs[0].text == e.outputs[0].text
        assert g.outputs[0].finish_reason == e.outputs[0].finish_reason
        assert g.outputs[0].stop_reason == e.outputs[0].stop_reason
        assert len(g.outputs[0].token_ids) <= p.max_tokens
    assert spec.engine.core.scheduler.spec_stats.num_accepted_tokens > 0
    assert_pool_clean(spec)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(repetition_penalty=1.3),
        dict(frequency_penalty=0.7, presence_penalty=0.4),
        dict(logit_bias={17: 3.0, 99: -100.0}),
        dict(min_tokens=6, stop_token_ids=[275]),  # 275: a token the model repeats early
    ],
    ids=["repetition", "frequency-presence", "logit-bias", "min-tokens"],
)
def test_penalties_apply_at_every_draft_position(target_model, draft_model, overrides):
    params = mixed_params(len(PROMPTS), seed=5, **overrides)
    expected = token_ids(generate(make_llm(target_model), PROMPTS, params))
    for config in (ngram(4), draft(target_model, 3)):
        llm = make_llm(target_model, config)
        assert token_ids(generate(llm, PROMPTS, params)) == expected
    # The target drafting for itself (without the penalties) still has drafts accepted; n-gram
    # finds few matches once penalties stop the tiny model repeating itself.
    assert llm.engine.core.scheduler.spec_stats.num_accepted_tokens > 0


def test_logprobs_of_emitted_tokens_match_plain_decoding(target_model):
    params = mixed_params(len(PROMPTS), seed=6, logprobs=3)
    expected = generate(make_llm(target_model), PROMPTS, params)
    llm = make_llm(target_model, ngram(4))
    got = generate(llm, PROMPTS, params)
    assert llm.engine.core.scheduler.spec_stats.num_accepted_tokens > 0
    for e, g in zip(expected, got):
        e_out, g_out = e.outputs[0], g.outputs[0]
        assert g_out.token_ids == e_out.token_ids
        assert len(g_out.logprobs) == len(g_out.token_ids)
        for e_pos, g_pos in zip(e_out.logprobs, g_out.logprobs):
            assert list(g_pos) == list(e_pos)  # same top tokens, same order
            for token in e_pos:
                assert g_pos[token].rank == e_pos[token].rank
                assert g_pos[token].logprob == pytest.approx(e_pos[token].logprob, abs=1e-4)


def test_a_request_at_the_context_limit_is_never_scheduled_past_it(target_model):
    """Drafts are trimmed to max_model_len: a repetitive request running into the limit ends
    there, with the tokens of plain decoding."""
    prompt = [5, 6, 7, 8] * 12
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    expected = token_ids(generate(make_llm(target_model, max_model_len=64), [prompt], params))
    llm = make_llm(target_model, ngram(6), max_model_len=64)
    got = generate(llm, [prompt], params)
    assert token_ids(got) == expected and len(expected[0]) == 64 - len(prompt)
    assert got[0].outputs[0].finish_reason == "length"
    assert llm.engine.core.scheduler.spec_stats.num_accepted_tokens > 0
    assert_pool_clean(llm)


@pytest.mark.parametrize("method", ["eagle", "gumiho"])
def test_a_head_drafts_fewer_for_a_request_near_the_context_limit(
    target_model, eagle_head, gumiho_head, method
):
    """A request close to max_model_len drafts fewer tokens than its neighbour far from it (the
    head's rows part ways between draft steps); both run to the limit with the tokens of plain
    decoding."""
    prompts = [[5, 6, 7, 8] * 12 + [9, 10], [11, 12, 13] * 3]
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    expected = token_ids(generate(make_llm(target_model, max_model_len=64), prompts, params))
    spec = eagle(eagle_head, 3) if method == "eagle" else gumiho(gumiho_head, 4)
    llm = make_llm(target_model, spec, max_model_len=64)
    assert token_ids(generate(llm, prompts, params)) == expected
    assert [len(t) for t in expected] == [64 - len(p) for p in prompts]
    assert_pool_clean(llm)


def test_n_greater_than_one_speculates_per_child(target_model):
    params = SamplingParams(n=3, temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = PROMPTS[:8]
    expected = generate(make_llm(target_model), prompts, params)
    llm = make_llm(target_model, ngram(4))
    got = generate(llm, prompts, params)
    for e, g in zip(expected, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in e.outputs]
    assert_pool_clean(llm)


def test_beam_search_runs_with_speculation(target_model):
    from octavo.entrypoints.beam_search import BeamSearchParams

    params = BeamSearchParams(beam_width=3, max_tokens=8)
    prompt = {"prompt_token_ids": PROMPTS[2]}
    expected = make_llm(target_model).beam_search([prompt], params)
    got = make_llm(target_model, ngram(4)).beam_search([prompt], params)
    assert [s.tokens for s in got[0].sequences] == [s.tokens for s in expected[0].sequences]


@pytest.mark.shared
@pytest.mark.parametrize("method", ["ngram", "self-draft"])
def test_stories260k_reference_continuations_with_speculation(stories260k_path, method):
    """The real trained model's recorded greedy continuations, unchanged by speculation."""
    import json

    reference = json.loads((stories260k_path / "reference_outputs.json").read_text())
    cases = [(r["prompt_ids"], r["new_ids"]) for r in reference["reference_outputs"]]
    for key in ("bos_greedy200", "once_upon_100"):
        cases.append((reference[key]["prompt_ids"], reference[key]["new_ids"]))
    config = ngram(4) if method == "ngram" else draft(stories260k_path, 3)
    llm = make_llm(stories260k_path, config, max_num_batched_tokens=64)
    params = [
        SamplingParams(temperature=0.0, max_tokens=len(expected), ignore_eos=True)
        for _, expected in cases
    ]
    assert token_ids(generate(llm, [p for p, _ in cases], params)) == [e for _, e in cases]
    assert llm.engine.core.scheduler.spec_stats.num_accepted_tokens > 0
    assert_pool_clean(llm)


def test_a_seeded_request_samples_the_same_tokens_alone_and_in_a_batch(target_model, draft_model):
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=32, ignore_eos=True)
    others = mixed_params(12, seed=9, temperature=1.0)
    for config in (ngram(4), draft(draft_model, 3)):
        alone = token_ids(generate(make_llm(target_model, config), [PROMPTS[2]], seeded))
        llm = make_llm(target_model, config)
        batch = generate(llm, [PROMPTS[2]] + PROMPTS[3:15], [seeded] + others)
        assert token_ids(batch)[0] == alone[0]
        assert llm.engine.core.scheduler.spec_stats.num_drafts > 0


def test_disable_by_batch_size_drafts_only_for_small_batches(target_model, baseline):
    llm = make_llm(target_model, ngram(4, disable_by_batch_size=4))
    batch_sizes = []
    step = llm.engine.core.runner.execute_model

    def record(scheduler_output):
        if scheduler_output.scheduled_spec_token_ids:
            batch_sizes.append(len(scheduler_output.num_scheduled_tokens))
        return step(scheduler_output)

    llm.engine.core.runner.execute_model = record
    assert token_ids(generate(llm, PROMPTS, PARAMS)) == baseline
    # alone, the repetitive prompts get drafts; in the full batch none until 3 are left
    repetitive = [i for i in range(len(PROMPTS)) if i % 3 == 2][:3]
    alone = generate(llm, [PROMPTS[i] for i in repetitive], [PARAMS[i] for i in repetitive])
    assert token_ids(alone) == [baseline[i] for i in repetitive]
    assert batch_sizes and max(batch_sizes) <= 3


def test_the_mean_acceptance_length_is_logged(target_model, caplog):
    from octavo.spec_decode.stats import SpecDecodeLog

    llm = make_llm(target_model, ngram(4))
    core = llm.engine.core
    core.spec_log = SpecDecodeLog(core.scheduler.spec_stats, interval_s=0.0)
    with caplog.at_level("INFO", logger="octavo.spec_decode"):
        generate(llm, PROMPTS[:6], PARAMS[:6])
    lines = [r.getMessage() for r in caplog.records if r.name == "octavo.spec_decode"]
    pattern = re.compile(
        r"mean acceptance length ([\d.]+) over (\d+) drafts \((\d+) of (\d+) draft tokens"
    )
    figures = [tuple(map(float, pattern.search(line).groups())) for line in lines]
    stats = core.scheduler.spec_stats
    # every verification is in exactly one line, and each line's mean is its own
    assert sum(f[1] for f in figures) == stats.num_drafts > 0
    assert sum(f[2] for f in figures) == stats.num_accepted_tokens
    assert sum(f[3] for f in figures) == stats.num_draft_tokens
    assert all(abs(f[0] - (1 + f[2] / f[1])) < 0.01 for f in figures)
