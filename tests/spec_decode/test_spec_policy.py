"""The adaptive rule on synthetic step times: drafts are kept while their expected tokens cost
less than a plain step's time per token, dropped when the step is compute-bound or a request's
drafts are rarely accepted, and probed again now and then."""

from __future__ import annotations

import math

from octavo.request import Request
from octavo.sampling_params import SamplingParams
from octavo.spec_decode.policy import EXPLORE_STEPS, SpeculationPolicy

K = 4


def request(seed=None) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(seed=seed))


def explored_policy(costs, acceptance: float, probe_interval: int = 1000) -> SpeculationPolicy:
    """A policy past its exploration, having seen steps timed exactly by
    ``a + b n + c_v D + c_p P + c_s [P > 0]`` over varied batches and drafts accepted at
    ``acceptance``."""
    a, b, verify_cost, propose_cost, drafting_cost = costs
    policy = SpeculationPolicy(K, probe_interval=probe_interval)
    for step in range(EXPLORE_STEPS):
        policy.start_step(num_decodes=8)
        batch = (1, 4, 32, 7)[step % 4] + step
        drafts = K * batch if step % 3 else 0
        proposed = (batch - step % 5) if step % 2 else 0
        seconds = a + b * batch + verify_cost * drafts + propose_cost * proposed
        seconds += drafting_cost * (proposed > 0)
        policy.observe_step(batch + drafts, drafts, proposed, seconds)
    for _ in range(30):
        policy.observe_verification(request(), K, round(K * acceptance))
    return policy


CPU_LIKE = (2e-3, 1e-4, 1.2e-4, 0.0, 0.0)  # a draft token costs about what a token does
DRAFT_MODEL = (2e-3, 1e-4, 1.2e-4, 1e-3, 2e-3)  # and drafting 2 ms, plus 1 ms per request


def test_the_step_costs_are_fitted_from_the_steps():
    policy = explored_policy(DRAFT_MODEL, 0.5)
    assert all(math.isclose(x, y, rel_tol=1e-4) for x, y in zip(policy.costs(), DRAFT_MODEL))
    assert abs(policy.acceptance_rate - 0.5) < 1e-3


def test_drafts_pay_at_small_batches_and_stop_paying_at_large_ones():
    policy = explored_policy(CPU_LIKE, 0.5)
    policy.start_step(num_decodes=1)  # 2.1 ms per emitted token: half of it beats 0.12 ms
    assert policy.allows(request()) and policy.propose_after
    policy.start_step(num_decodes=64)  # (2 + 6.4) / 64 = 0.13 ms per token: half is < 0.12
    assert not policy.allows(request()) and not policy.propose_after


def test_a_costly_proposer_needs_a_better_acceptance():
    # One request: 0.12 + (1 + 2) / 4 = 0.87 ms per draft token, under half of 2.1 ms per
    # token. Eight: 0.12 + (1 + 2 / 8) / 4 = 0.43 ms, over half of (2 + 0.8) / 8 = 0.35 ms.
    policy = explored_policy(DRAFT_MODEL, 0.5)
    policy.start_step(num_decodes=1)
    assert policy.allows(request())
    policy.start_step(num_decodes=8)
    assert not policy.allows(request())


def test_a_request_whose_drafts_are_rarely_accepted_stops_getting_them():
    policy = explored_policy(CPU_LIKE, 0.6)
    good, bad = request(), request()
    for _ in range(10):
        policy.observe_verification(good, K, 3)
        policy.observe_verification(bad, K, 0)
    policy.start_step(num_decodes=24)  # (2 + 2.4) / 24 = 0.18 ms per token: needs 0.65
    assert policy.allows(good) and not policy.allows(bad)


def test_exploration_cycles_through_the_four_kinds_of_step():
    policy = SpeculationPolicy(K)
    kinds = []
    for _ in range(8):
        policy.start_step(num_decodes=64)
        kinds.append((policy.allows(request()), policy.propose_after))
    assert kinds[:4] == [(False, True), (True, True), (True, False), (False, False)]
    assert kinds[4:] == kinds[:4]


def test_while_drafts_do_not_pay_they_are_proposed_then_verified_once_per_interval():
    policy = explored_policy(CPU_LIKE, 0.5, probe_interval=8)
    verdicts = []
    for _ in range(16):
        policy.start_step(num_decodes=64)
        verdicts.append((policy.allows(request()), policy.propose_after))
    assert verdicts.count((True, False)) == 2  # the probe: drafts verified
    assert verdicts.count((False, True)) == 2  # the step before it proposes them
    assert policy.allows(request(seed=3))  # a seeded request's draws must not depend on time
