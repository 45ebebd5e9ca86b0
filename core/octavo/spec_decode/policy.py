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

Drafts are used ("on") unless they are measured slower; until both have been measured at a
batch size, that size runs each for ``MIN_STEPS`` steps. A step drafts for the next one only
if drafts are also on at the next step's batch size (the step that admits many prompts drafts
for none where many decodes run faster without). Switching on costs one step that proposes
but has nothing to verify; it is not measured, nor is a step with drafts on after one that
drafted none. Which drafts run changes only speed,
never tokens (verification is lossless); seeded requests always get theirs, since their random
draws depend on how many drafts they verify and must not depend on the clock.
"""

from __future__ import annotations

from octavo.request import Request

MIN_STEPS = 4  # measured steps of each kind before a batch size is decided
MARGIN = 1.03  # drafts must be this much faster to stay on: noise must not make it flap
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
        self.on = True
        self._bucket = 0
        self._steps_in_mode = 1  # the first step after switching on is not measured
        self._proposed = True  # whether the last step drafted for every request

    @staticmethod
    def bucket(num_decodes: int) -> int:
        return max(num_decodes, 1).bit_length()  # 1, 2-3, 4-7, 8-15, ...

    def start_step(self, num_decodes: int) -> None:
        """Decide this step for ``num_decodes`` running requests."""
        bucket = self._bucket = self.bucket(num_decodes)
        step = self._steps[bucket] = self._steps.get(bucket, 0) + 1
        on = self._preferred(bucket)
        if self._decided(bucket) and step % self._probe_interval(bucket) < self.probe_steps:
            on = not on
        if on != self.on or (on and not self._proposed):  # on with nothing to verify: switching
            self.on, self._steps_in_mode = on, 0

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
        return self.rates[bucket, True] > MARGIN * self.rates[bucket, False]

    def propose_after(self, num_running: int) -> bool:
        """Whether the runner drafts for every request after this step, whose next step has
        ``num_running`` requests: as this step verifies drafts, unless the next step's batch
        size is in another bucket whose verdict is off (a step that starts a batch of many
        decodes from prompts must not draft for them at the few decodes it had before)."""
        bucket = self.bucket(num_running)
        self._proposed = self.on and (bucket == self._bucket or self._preferred(bucket))
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
        drafts."""
        self._steps_in_mode += 1
        decode = num_tokens - num_draft_tokens == num_requests
        if self._steps_in_mode == 1 or seconds <= 0 or not decode:
            return  # just switched (on: nothing to verify yet), or prefill in the step
        key = (self._bucket, self.on)
        rate = num_emitted / seconds
        count = self.counts.get(key, 0)
        self.rates[key] = (
            rate if count == 0 else self.rates[key] + SMOOTHING * (rate - self.rates[key])
        )
        self.counts[key] = count + 1
