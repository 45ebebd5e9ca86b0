"""Prometheus metrics of one engine (SPEC O1, C4), in a registry of their own.

The engine thread updates them (``on_*`` methods, once per request event or engine step); the
HTTP layer counts the requests it turns away before they reach the engine. Counters of the engine
core (preemptions, prefix-cache queries and hits) are cumulative there, so each step adds only
the difference since the previous step.

Two namings of the same quantities (``--metrics-naming``): octavo's own (``octavo_*``, no labels)
and vLLM's (``vllm:*`` with its ``model_name`` and ``engine`` labels, as vLLM v1's
``vllm/v1/metrics/loggers.py`` and ``vllm/v1/spec_decode/metrics.py`` name them), so dashboards,
alerts, autoscalers and routers written for vLLM read octavo unchanged. The request counter by
outcome (``octavo_requests_total{status}``) has no vLLM counterpart and is in both.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from octavo.spec_decode.stats import SpecDecodeStats

# Outcomes of ``octavo_requests_total{status}``: one per engine request (one per prompt), or
# per HTTP request for those turned away before they reached the engine.
REQUEST_STATUSES = ("finished", "aborted", "failed", "invalid", "rejected")

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
)


@dataclasses.dataclass(frozen=True)
class MetricNames:
    """The exposed name of each quantity in one naming; None: not exported in it. Counters are
    named without ``_total``, which prometheus_client appends."""

    labels: tuple[str, ...]
    request_latency: str
    time_to_first_token: str
    request_time_per_output_token: str
    inter_token_latency: Optional[str]  # each gap between a request's token-producing steps
    request_success: Optional[str]  # finished requests by finish reason
    generation_tokens: str
    prompt_tokens: str
    num_preemptions: str
    num_running: str
    num_waiting: str
    kv_cache_usage: str
    prefix_cache_queries: str
    prefix_cache_hits: str
    spec_decode_prefix: str


METRIC_NAMINGS = {
    "octavo": MetricNames(
        labels=(),
        request_latency="octavo_request_latency_seconds",
        time_to_first_token="octavo_time_to_first_token_seconds",
        request_time_per_output_token="octavo_inter_token_latency_seconds",
        inter_token_latency=None,
        request_success=None,
        generation_tokens="octavo_tokens_generated",
        prompt_tokens="octavo_prompt_tokens",
        num_preemptions="octavo_num_requests_preempted",
        num_running="octavo_num_requests_running",
        num_waiting="octavo_num_requests_waiting",
        kv_cache_usage="octavo_kv_cache_usage_ratio",
        prefix_cache_queries="octavo_prefix_cache_queries",
        prefix_cache_hits="octavo_prefix_cache_hits",
        spec_decode_prefix="octavo_spec_decode",
    ),
    "vllm": MetricNames(
        labels=("model_name", "engine"),
        request_latency="vllm:e2e_request_latency_seconds",
        time_to_first_token="vllm:time_to_first_token_seconds",
        request_time_per_output_token="vllm:request_time_per_output_token_seconds",
        inter_token_latency="vllm:inter_token_latency_seconds",
        request_success="vllm:request_success",
        generation_tokens="vllm:generation_tokens",
        prompt_tokens="vllm:prompt_tokens",
        num_preemptions="vllm:num_preemptions",
        num_running="vllm:num_requests_running",
        num_waiting="vllm:num_requests_waiting",
        kv_cache_usage="vllm:kv_cache_usage_perc",
        prefix_cache_queries="vllm:prefix_cache_queries",
        prefix_cache_hits="vllm:prefix_cache_hits",
        spec_decode_prefix="vllm:spec_decode",
    ),
}
"""``--metrics-naming`` choices."""

# vLLM's finish reasons (its FinishReason); octavo's finish_reason strings are the same words.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


class _Family:
    """Makes one naming's metrics: each with the naming's labels, fixed to this engine's values
    (``model_name``, ``engine`` "0"), plus any of its own."""

    def __init__(self, names: MetricNames, model_name: str, registry: CollectorRegistry) -> None:
        self.names = names
        self.values = {"model_name": model_name, "engine": "0"}
        self.registry = registry

    def make(self, kind, name: str, documentation: str, extra: tuple[str, ...] = (), **kw):
        """The metric's child for this engine, or a _Partial when ``extra`` labels stay open."""
        labels = self.names.labels
        metric = kind(name, documentation, [*labels, *extra], registry=self.registry, **kw)
        values = [self.values[label] for label in labels]
        if extra:
            return _Partial(metric, values)
        return metric.labels(*values) if values else metric


class _Partial:
    """A labelled metric with this engine's labels given: ``labels(*extra)`` gives the child."""

    def __init__(self, metric: Any, values: list[str]) -> None:
        self.metric, self.values = metric, values

    def labels(self, *extra: str) -> Any:
        return self.metric.labels(*self.values, *extra)


class EngineMetrics:
    """The metrics of one engine in ``naming`` (a key of ``METRIC_NAMINGS``); ``render()`` gives
    the Prometheus text format."""

    def __init__(
        self,
        registry: Optional[CollectorRegistry] = None,
        naming: str = "octavo",
        model_name: str = "",
    ) -> None:
        if naming not in METRIC_NAMINGS:
            raise ValueError(
                f"metrics naming must be one of {sorted(METRIC_NAMINGS)}; got {naming!r}"
            )
        self.registry = registry if registry is not None else CollectorRegistry()
        self.naming = naming
        names = METRIC_NAMINGS[naming]
        family = _Family(names, model_name, self.registry)
        self._add_request_metrics(family.make, names)
        self._add_engine_metrics(family.make, names)
        self.spec_decode = SpecDecodeMetrics(family)
        # Last seen cumulative values of the engine core (touched by the engine thread only).
        self._seen_preempted = 0
        self._seen_queries = 0
        self._seen_hits = 0

    def _add_request_metrics(self, make, names: MetricNames) -> None:
        """Counters and latencies of requests (updated as they arrive, stream and finish)."""
        self.requests = make(
            Counter,
            "octavo_requests",
            "Requests by outcome: finished, aborted (client gone), failed (engine error), "
            "invalid (400/404), rejected (queue full)",
            ("status",),
        )
        for status in REQUEST_STATUSES:
            self.requests.labels(status)  # export zeros from the start
        self.request_latency = make(
            Histogram,
            names.request_latency,
            "Arrival to finish of finished requests",
            buckets=LATENCY_BUCKETS,
        )
        self.time_to_first_token = make(
            Histogram,
            names.time_to_first_token,
            "Arrival to first output token",
            buckets=TTFT_BUCKETS,
        )
        self.request_time_per_output_token = make(
            Histogram,
            names.request_time_per_output_token,
            "Mean time between output tokens, one observation per finished request",
            buckets=ITL_BUCKETS,
        )
        self.inter_token_latency = None
        if names.inter_token_latency is not None:
            self.inter_token_latency = make(
                Histogram,
                names.inter_token_latency,
                "Time between a request's successive steps that gave it tokens",
                buckets=ITL_BUCKETS,
            )
        self.request_success = None
        if names.request_success is not None:
            self.request_success = make(
                Counter,
                names.request_success,
                "Finished requests by finish reason",
                ("finished_reason",),
            )
            for reason in FINISH_REASONS:
                self.request_success.labels(reason)

    def _add_engine_metrics(self, make, names: MetricNames) -> None:
        """Token counters, scheduler gauges and the KV cache's (updated each step)."""
        self.tokens_generated = make(Counter, names.generation_tokens, "Output tokens generated")
        self.prompt_tokens = make(
            Counter, names.prompt_tokens, "Prompt tokens of requests admitted to the engine"
        )
        self.num_preempted = make(Counter, names.num_preemptions, "Preemptions (recompute or swap)")
        self.num_running = make(Gauge, names.num_running, "Requests in the running batch")
        self.num_waiting = make(
            Gauge,
            names.num_waiting,
            "Requests waiting to be scheduled (swapped-out ones included)",
        )
        self.kv_cache_usage = make(
            Gauge, names.kv_cache_usage, "Fraction of KV cache blocks in use (1 is all)"
        )
        self.prefix_cache_queries = make(
            Counter, names.prefix_cache_queries, "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_cache_hits = make(
            Counter, names.prefix_cache_hits, "Prompt tokens found in the prefix cache"
        )

    # --- from the HTTP layer --------------------------------------------------------------------

    def on_request_refused(self, status: str) -> None:
        """A request turned away before the engine saw it (``invalid`` or ``rejected``)."""
        self.requests.labels(status).inc()

    # --- from the engine thread -----------------------------------------------------------------

    def on_request_added(self, num_prompt_tokens: int) -> None:
        """A request entered the engine."""
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_tokens(self, num_new_tokens: int) -> None:
        """Output tokens a request produced since its previous output."""
        if num_new_tokens:
            self.tokens_generated.inc(num_new_tokens)

    def on_request_finished(self, output: Any) -> None:
        """A RequestOutput with ``finished`` set: count its outcome and observe its latencies."""
        reasons = [completion.finish_reason for completion in output.outputs]
        aborted = "abort" in reasons
        self.requests.labels("aborted" if aborted else "finished").inc()
        if self.request_success is not None:
            reason = "abort" if aborted else next((r for r in reasons if r), "stop")
            self.request_success.labels(reason).inc()
        metrics = output.metrics
        if metrics is not None and self.inter_token_latency is not None:
            for gap in metrics.token_gaps:
                self.inter_token_latency.observe(gap)
        if metrics is None or aborted:
            return
        if metrics.finished_time is not None:
            self.request_latency.observe(metrics.finished_time - metrics.arrival_time)
        if metrics.first_token_time is not None:
            self.time_to_first_token.observe(metrics.first_token_time - metrics.arrival_time)
            num_gaps = metrics.num_generation_tokens - 1
            if num_gaps > 0 and metrics.last_token_time is not None:
                self.request_time_per_output_token.observe(
                    (metrics.last_token_time - metrics.first_token_time) / num_gaps
                )

    def on_request_failed(self) -> None:
        """A request ended by an engine error."""
        self.requests.labels("failed").inc()
        if self.request_success is not None:
            self.request_success.labels("error").inc()

    def on_step(self, core: Any) -> None:
        """Refresh gauges and core counters from an EngineCore after a step or an abort."""
        scheduler = core.scheduler
        kv = core.kv_cache_manager
        self.num_running.set(len(scheduler.running))
        self.num_waiting.set(len(scheduler.waiting) + len(scheduler.swapped))
        self.kv_cache_usage.set(kv.usage)
        self._seen_preempted = _add_difference(
            self.num_preempted, scheduler.stats.num_preempted_total, self._seen_preempted
        )
        self._seen_queries = _add_difference(
            self.prefix_cache_queries, kv.prefix_cache_queries, self._seen_queries
        )
        self._seen_hits = _add_difference(
            self.prefix_cache_hits, kv.prefix_cache_hits, self._seen_hits
        )
        self.spec_decode.update(scheduler.spec_stats)

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format."""
        return generate_latest(self.registry)


class SpecDecodeMetrics:
    """The speculative-decoding counters (``<prefix>_num_drafts`` and the rest), fed the
    scheduler's cumulative SpecDecodeStats."""

    def __init__(self, family: _Family) -> None:
        prefix = family.names.spec_decode_prefix
        self.num_drafts = family.make(
            Counter,
            f"{prefix}_num_drafts",
            "Speculative decoding: verifications (a request's step with at least one draft)",
        )
        self.num_draft_tokens = family.make(
            Counter, f"{prefix}_num_draft_tokens", "Draft tokens scheduled and verified"
        )
        self.num_accepted_tokens = family.make(
            Counter, f"{prefix}_num_accepted_tokens", "Draft tokens accepted"
        )
        self.num_accepted_tokens_per_pos = family.make(
            Counter,
            f"{prefix}_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0-based)",
            ("position",),
        )
        self._seen = SpecDecodeStats()

    def update(self, stats: SpecDecodeStats) -> None:
        if stats.num_drafts <= self._seen.num_drafts:
            return
        new = stats.since(self._seen)
        self.num_drafts.inc(new.num_drafts)
        self.num_draft_tokens.inc(new.num_draft_tokens)
        self.num_accepted_tokens.inc(new.num_accepted_tokens)
        for position, count in enumerate(new.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos.labels(str(position)).inc(count)
        self._seen = stats.copy()


def _add_difference(counter: Counter, total: int, seen: int) -> int:
    if total > seen:
        counter.inc(total - seen)
    return max(total, seen)
