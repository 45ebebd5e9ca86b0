"""The adaptive rule on synthetic step times: at each batch size the faster of decoding with and
without drafts runs, both are measured first, the other is probed now and then, and seeded
requests keep their drafts."""

from __future__ import annotations

from octavo.request import Request
from octavo.sampling_params import SamplingParams
from octavo.spec_decode.policy import MIN_STEPS, SpeculationPolicy


def request(seed=None) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(seed=seed))


def run(policy: SpeculationPolicy, num_decodes: int, steps: int, speed) -> list[bool]:
    """``steps`` decode steps of ``num_decodes`` requests; ``speed(on)`` gives the tokens per
    second the step emits at. Returns whether drafts were on at each step; asserts that each
    step drafted for the next exactly when the next had drafts on (while no verdict changed)."""
    modes, proposed, verdicts = [], [], []
    for _ in range(steps):
        policy.start_step(num_decodes)
        on = policy.allows(request())
        verifies = on and bool(proposed) and proposed[-1]
        modes.append(on)
        verdicts.append(policy._decided(policy.bucket(num_decodes)))
        proposed.append(policy.propose_after(num_decodes))
        emitted = num_decodes * (2 if verifies else 1)
        drafts = 3 * num_decodes if verifies else 0
        policy.observe_step(num_decodes, num_decodes + drafts, drafts, emitted, emitted / speed(on))
    decided = [i for i in range(steps - 1) if verdicts[i] and verdicts[i + 1]]
    settled = [i for i in decided if i > 0 and verdicts[i - 1]]
    assert sum(proposed[i] != modes[i + 1] for i in settled) <= 1
    return modes


def test_each_batch_size_runs_the_faster_mode_after_measuring_both():
    policy = SpeculationPolicy(probe_interval=1000)
    # one request: drafts double the speed; 32: they halve it
    small = run(policy, 1, 30, lambda on: 200.0 if on else 100.0)
    large = run(policy, 32, 30, lambda on: 500.0 if on else 1000.0)
    # on first (its first step has no drafts to verify: not measured), then off, then on
    assert small[: 2 * MIN_STEPS + 1] == [True] * (MIN_STEPS + 1) + [False] * MIN_STEPS
    assert all(small[2 * MIN_STEPS + 1 :])
    assert not any(large[-10:])
    assert policy.rates[policy.bucket(32), True] < policy.rates[policy.bucket(32), False]
    # the small batch size keeps its own verdict
    assert all(run(policy, 1, 5, lambda on: 200.0 if on else 100.0))


def test_a_mode_within_the_margin_of_the_other_does_not_keep_drafts_on():
    policy = SpeculationPolicy(probe_interval=1000)
    modes = run(policy, 8, 40, lambda on: 1010.0 if on else 1000.0)  # 1% faster: noise
    assert not any(modes[-10:])


def test_the_other_mode_is_probed_now_and_then():
    policy = SpeculationPolicy(probe_interval=16, probe_steps=4)
    modes = run(policy, 32, 64, lambda on: 500.0 if on else 1000.0)
    settled = modes[32:]
    assert 0 < settled.count(True) <= len(settled) // 4


def test_a_verdict_stays_while_the_other_mode_is_within_the_margin():
    """Drafts on (20% faster), then about as fast as none (1% slower): a change of verdict
    would cost steps of both modes for nothing, so drafts stay on, but for the probes; once
    none is clearly faster, the verdict follows."""
    policy = SpeculationPolicy(probe_interval=32, probe_steps=3)
    run(policy, 4, 40, lambda on: 1200.0 if on else 1000.0)
    modes = run(policy, 4, 320, lambda on: 990.0 if on else 1000.0)
    assert sum(modes[-96:]) >= 96 - 3 * 3
    modes = run(policy, 4, 320, lambda on: 900.0 if on else 1000.0)
    assert sum(modes[-96:]) <= 3 * 3


def test_the_verdict_follows_a_change_in_speed():
    policy = SpeculationPolicy(probe_interval=8, probe_steps=3)
    run(policy, 4, 40, lambda on: 500.0 if on else 1000.0)
    # drafts got good: a few probes move the slow average past the margin, then it stays on
    modes = run(policy, 4, 160, lambda on: 3000.0 if on else 1000.0)
    assert not any(modes[:8])
    assert sum(modes[-32:]) >= 28  # on, but for the probes of the now-losing mode


def test_seeded_requests_keep_their_drafts_and_prefill_steps_are_not_measured():
    policy = SpeculationPolicy(probe_interval=1000)
    run(policy, 32, 30, lambda on: 500.0 if on else 1000.0)
    policy.start_step(32)
    assert not policy.allows(request()) and policy.allows(request(seed=3))
    counts = dict(policy.counts)
    policy.observe_step(32, 900, 0, 32, 1.0)  # a step with prefill chunks
    assert policy.counts == counts


def test_a_step_drafts_for_the_batch_size_of_the_step_that_verifies():
    """A step of few decodes that brings many prompts to decoding drafts for none of them
    where drafts are slower at the many; a step with drafts on after a step that drafted none
    has nothing to verify, and is not measured."""
    policy = SpeculationPolicy(probe_interval=1000)
    run(policy, 1, 10, lambda on: 200.0 if on else 100.0)
    run(policy, 16, 10, lambda on: 500.0 if on else 1000.0)
    policy.start_step(1)
    assert policy.allows(request())  # drafts on for the one decode of this step
    assert policy.propose_after(1) and not policy.propose_after(16)
    policy.observe_step(16, 16 * 64, 0, 1, 0.1)  # the prompts' step: not measured
    counts = dict(policy.counts)
    policy.start_step(1)  # the batch stayed small (say the prompts were aborted)
    assert policy.allows(request())
    policy.observe_step(1, 1, 0, 1, 0.01)  # one token: no drafts were there to verify
    assert policy.counts == counts
    assert policy.propose_after(1)
    policy.start_step(1)
    policy.observe_step(1, 4, 3, 3, 0.01)
    assert policy.counts[policy.bucket(1), True] == counts[policy.bucket(1), True] + 1
