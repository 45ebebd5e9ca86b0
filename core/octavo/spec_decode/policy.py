"""When speculation pays: drafts are used at the batch sizes where they are measured to give
more tokens per second than decoding without them.

Whether drafts pay depends on the hardware, the model and the workload together: a step of a
few requests is dominated by fixed costs (weights streamed once, Python, kernel launches), so
the extra tokens of verified drafts come nearly free; a step of many is dominated by per-token
compute (on a CPU the forward is compute-bound), so drafts cost about what the tokens they
might add would, and stop paying however well they are accepted. A model of those costs has to
be fitted from steps that rarely vary the features independently, so the policy measures the
quantity itself instead: for each batch size (in powers of two of the decoding requests) it
keeps the tokens emitted per second of decode steps with drafts (proposing and verifying) and
without, runs the better, and now and then runs the other for a few steps (3 in 32, or in 128
once one is 25% faster), so that both stay measured as the workload changes.

Until both modes have been measured at a batch size, that size runs each for ``MIN_STEPS``
steps (drafts "on" first); drafts then stay on if they are ``MARGIN`` faster. After that a
verdict changes only when the other mode is ``MARGIN`` faster than its own: where both are
about as fast, noise does not make it flap. A step drafts for the next one when drafts are on
at the next step (its batch size's verdict or probe, known a step ahead), so a probe's drafts
are ready at its first step and none are made after its last, and the step that admits many
prompts drafts for none where many decodes run faster without. The steps where that
foresight fails (a verdict that changes, a batch that changes size otherwise than foreseen)
are not measured. Which drafts run changes only speed, never tokens (verification is
lossless); seeded requests always get theirs, since their random draws depend on how many
drafts they verify and must not depend on the clock.
"""

from __future__ import annotations

from octavo.request import Request

MIN_STEPS = 4  # measured steps of each kind before a batch size is decided
MARGIN = 1.03  # a mode must be this much faster to take over: noise must not make it flap
SMOOTHING = 0.05  # slow: a verdict on typical steps, not on the last few
CLEAR = 1.25  # a mode this much faster is probed against four times less often


class SpeculationPolicy:
    """Decides, each step, whether drafts are verified and proposed (see the module
    docstring)."""

    def __init__(self, probe_interval: int = 32, probe_steps: int = 3):
        self.probe_interval, self.probe_steps = probe_interval, probe_steps
        self.rates: dict[tuple[int, bool], float] = {}  # (batch bucket, on) -> tokens/s
        self.counts: dict[tuple[int, bool], int] = {}
        self._steps: dict[int, int] = {}  # steps per bucket, for probing
        self._verdicts: dict[int, bool] = {}  # decided buckets: drafts on or off
        self.on = True
        self._bucket = 0
        self._proposed = False  # whether the last step drafted for every request
        self._to_verify = False  # whether this step has the drafts of every request to verify

    @staticmethod
    def bucket(num_decodes: int) -> int:
        return max(num_decodes, 1).bit_length()  # 1, 2-3, 4-7, 8-15, ...

    def start_step(self, num_decodes: int) -> None:
        """Decide this step for ``num_decodes`` running requests."""
        bucket = self._bucket = self.bucket(num_decodes)
        step = self._steps[bucket] = self._steps.get(bucket, 0) + 1
        self.on, self._to_verify = self._mode(bucket, step), self._proposed

    def _mode(self, bucket: int, step: int) -> bool:
        """Drafts on or off at ``bucket``'s ``step``: its verdict, or the other mode when the
        step is one of a probe's."""
        on = self._preferred(bucket)
        if self._decided(bucket) and step % self._probe_interval(bucket) < self.probe_steps:
            on = not on
        return on

    def _probe_interval(self, bucket: int) -> int:
        """Steps between probes: four times ``probe_interval`` once one mode is a clear
        winner (25% faster), so that a clear verdict costs little."""
        ratio = self.rates[bucket, True] / self.rates[bucket, False]
        return self.probe_interval * (4 if ratio > CLEAR or ratio < 1 / CLEAR else 1)

    def _decided(self, bucket: int) -> bool:
        return min(self.counts.get((bucket, True), 0), self.counts.get((bucket, False), 0)) >= (
            MIN_STEPS
        )

    def _preferred(self, bucket: int) -> bool:
        if self.counts.get((bucket, True), 0) < MIN_STEPS:
            return True
        if self.counts.get((bucket, False), 0) < MIN_STEPS:
            return False
        return self._verdicts[bucket]

    def _update_verdict(self, bucket: int) -> None:
        """Drafts on when first decided if they are ``MARGIN`` faster; after that the other
        mode takes over only once it is ``MARGIN`` faster than the verdict's: where the two
        are about as fast, the verdict stays (each change costs steps of both)."""
        if not self._decided(bucket):
            return
        ratio = self.rates[bucket, True] / self.rates[bucket, False]
        verdict = self._verdicts.get(bucket)
        if verdict is None:
            self._verdicts[bucket] = ratio > MARGIN
        elif verdict and ratio < 1 / MARGIN:
            self._verdicts[bucket] = False
        elif not verdict and ratio > MARGIN:
            self._verdicts[bucket] = True

    def propose_after(self, num_running: int) -> bool:
        """Whether the runner drafts for every request after this step: whether drafts are on
        at the next step, whose ``num_running`` requests set its bucket (as the verdicts stand
        now). Proposals are then neither wasted at the last step with drafts on (a probe's, or
        one that starts a batch of many decodes from prompts) nor missing at the first."""
        bucket = self.bucket(num_running)
        self._proposed = self._mode(bucket, self._steps.get(bucket, 0) + 1)
        return self._proposed

    def allows(self, request: Request) -> bool:
        """True when ``request``'s drafts are verified this step."""
        return self.on or request.sampling_params.seed is not None

    def observe_step(
        self,
        num_requests: int,
        num_tokens: int,
        num_draft_tokens: int,
        num_emitted: int,
        seconds: float,
    ) -> None:
        """A step of ``num_requests`` requests ran ``num_tokens`` tokens, ``num_draft_tokens``
        of them drafts, and emitted ``num_emitted`` in ``seconds``. Only decode steps (one
        token of each request's own) are measured: a prefill chunk's cost says nothing about
        drafts. Nor is a step that does not draft as its mode does (drafts on with none
        proposed after it, or off with proposals), or on with nothing to verify: each costs
        what neither mode does."""
        decode = num_tokens - num_draft_tokens == num_requests
        typical = self._proposed == self.on and (self._to_verify or not self.on)
        if not typical or seconds <= 0 or not decode:
            return
        key = (self._bucket, self.on)
        rate = num_emitted / seconds
        count = self.counts.get(key, 0)
        self.rates[key] = (
            rate if count == 0 else self.rates[key] + SMOOTHING * (rate - self.rates[key])
        )
        self.counts[key] = count + 1
        self._update_verdict(self._bucket)
