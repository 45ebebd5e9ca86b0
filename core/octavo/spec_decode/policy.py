"""When speculation pays: drafts are scheduled while the tokens they are expected to add cost
less time than they do.

A step's time is modelled as ``t = a + b n + c_v D + c_p P + c_s [P > 0]``: a fixed cost
``a``, ``b`` per token of the requests' own (``n``), ``c_v`` per draft token verified (``D``:
its share of the forward and of the verification), ``c_p`` per request the proposer drafts for
after the step (``P``) and ``c_s`` once for drafting at all (a draft model's K forwards cost
much the same for one request or many; n-gram lookup costs next to nothing). At ``N`` decoding
requests a request drafting ``k`` tokens, each accepted with probability ``alpha``, adds about
``alpha k`` tokens for ``k c_v + c_p + c_s / N`` seconds, while a step without drafts spends
``t(N) / N`` per emitted token. So its drafts pay exactly when

    alpha * t(N) / N > c_v + (c_p + c_s / N) / k.

Small batches are dominated by ``a``, so drafts pay; large ones by ``b`` (on a CPU, where the
forward is compute-bound, ``c_v`` is close to ``b``), so they stop paying however well they are
accepted; a request whose drafts are rarely accepted stops getting them first.

Everything is measured on the running engine: the five costs by least squares over every step,
``alpha`` per request (an average of its recent acceptance, starting from the engine-wide one).
To tell the costs apart the policy first cycles through the four kinds of step (proposing only,
verifying and proposing, verifying only, neither); afterwards it still makes one step in
``probe_interval`` of the kind it avoids, so that both sides stay measured when the workload
changes, and while drafts pay, one step in ``probe_interval`` verifies every request's drafts,
so that a request left out for its poor acceptance is measured again. Which drafts it lets
through changes only speed, never tokens (verification is lossless); seeded requests are left
alone: their random draws depend on how many drafts they verify, and must not depend on the
clock.
"""

from __future__ import annotations

import math

import numpy as np

from octavo.request import Request

EXPLORE_STEPS = 32  # steps of the four-kind cycle before the costs are trusted
_CYCLE = ((False, True), (True, True), (True, False), (False, False))  # (verify, propose)


class SpeculationPolicy:
    """Decides, each step, which requests verify their drafts and whether the runner proposes
    after it (see the module docstring)."""

    def __init__(self, num_speculative_tokens: int, probe_interval: int = 32):
        self.k, self.probe_interval = num_speculative_tokens, probe_interval
        self.smoothing = 0.2
        self._gram = np.eye(5) * 1e-9  # least squares of step seconds on [1, n, D, P, P > 0]
        self._moment = np.zeros(5)
        self.acceptance_rate = 0.5  # alpha over every request: the prior of a new request
        self.num_steps = 0
        self._threshold = 0.0  # this step's alpha above which drafts pay (inf: none do)
        self.propose_after = True  # whether the runner drafts after this step

    # --- measurements ---------------------------------------------------------------------------

    def costs(self) -> np.ndarray:
        """``[a, b, c_v, c_p, c_s]`` in seconds, as measured so far."""
        return np.linalg.solve(self._gram, self._moment)

    def observe_step(
        self, num_tokens: int, num_draft_tokens: int, num_proposed: int, seconds: float
    ) -> None:
        """A step ran ``num_tokens`` tokens, ``num_draft_tokens`` of them drafts, then drafted
        for ``num_proposed`` requests, in ``seconds``."""
        features = np.array(
            [1.0, num_tokens - num_draft_tokens, num_draft_tokens, num_proposed, num_proposed > 0]
        )
        self._gram += np.outer(features, features)
        self._moment += features * seconds

    def observe_verification(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        rate = num_accepted / num_drafts
        previous = request.spec_acceptance_rate
        if previous is None:
            previous = self.acceptance_rate
        request.spec_acceptance_rate = previous + self.smoothing * (rate - previous)
        self.acceptance_rate += self.smoothing * (rate - self.acceptance_rate)

    # --- the decision -------------------------------------------------------------------------

    def start_step(self, num_decodes: int) -> None:
        """Decide this step for ``num_decodes`` decoding requests."""
        step = self.num_steps
        self.num_steps += 1
        if step < EXPLORE_STEPS:
            verify, self.propose_after = _CYCLE[step % len(_CYCLE)]
            self._threshold = 0.0 if verify else math.inf
            return
        self._threshold = self.threshold(num_decodes)
        pays = self.acceptance_rate > self._threshold
        probe = step % self.probe_interval
        if pays:  # now and then a step without drafts, to keep measuring the plain cost, and
            self.propose_after = True  # one with every draft, for requests left out
            if probe == 0:
                self._threshold = math.inf
            elif probe == self.probe_interval // 2:
                self._threshold = 0.0
        else:  # now and then drafts proposed, then verified, to keep measuring their worth
            self.propose_after = probe == self.probe_interval - 1
            if probe == 0:
                self._threshold = 0.0

    def threshold(self, num_decodes: int) -> float:
        """The acceptance rate above which a request's drafts pay at ``num_decodes`` requests."""
        a, b, verify_cost, propose_cost, drafting_cost = self.costs()
        n = max(num_decodes, 1)
        per_token = (a + b * n) / n
        propose_cost = max(propose_cost, 0.0) + max(drafting_cost, 0.0) / n
        draft_cost = max(verify_cost, 0.0) + propose_cost / self.k
        return draft_cost / per_token if per_token > 0 else math.inf

    def allows(self, request: Request) -> bool:
        """True when ``request``'s drafts are verified this step."""
        if self._threshold == 0.0 or request.sampling_params.seed is not None:
            return True
        rate = request.spec_acceptance_rate
        return (self.acceptance_rate if rate is None else rate) > self._threshold
