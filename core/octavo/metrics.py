"""Prometheus metrics of one engine (SPEC O1, C4), in a registry of their own.

The engine thread updates them (``on_*`` methods, once per request event or engine step); the
HTTP layer counts the requests it turns away before they reach the engine. Counters of the engine
core (preemptions, prefix-cache queries and hits) are cumulative there, so each step adds only
the difference since the previous step.
"""

from __future__ import annotations

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


class EngineMetrics:
    """The ``octavo_*`` metrics of one engine; ``render()`` gives the Prometheus text format."""

    def __init__(self, registry: Optional[CollectorRegistry] = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "octavo_requests",
            "Requests by outcome: finished, aborted (client gone), failed (engine error), "
            "invalid (400/404), rejected (queue full)",
            ["status"],
            registry=r,
        )
        for status in REQUEST_STATUSES:
            self.requests.labels(status)  # export zeros from the start
        self.request_latency = Histogram(
            "octavo_request_latency_seconds",
            "Arrival to finish of finished requests",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "octavo_time_to_first_token_seconds",
            "Arrival to first output token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "octavo_inter_token_latency_seconds",
            "Mean time between output tokens, one observation per finished request",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.tokens_generated = Counter(
            "octavo_tokens_generated", "Output tokens generated", registry=r
        )
        self.prompt_tokens = Counter(
            "octavo_prompt_tokens", "Prompt tokens of requests admitted to the engine", registry=r
        )
        self.num_preempted = Counter(
            "octavo_num_requests_preempted", "Preemptions (recompute or swap)", registry=r
        )
        self.num_running = Gauge(
            "octavo_num_requests_running", "Requests in the running batch", registry=r
        )
        self.num_waiting = Gauge(
            "octavo_num_requests_waiting",
            "Requests waiting to be scheduled (swapped-out ones included)",
            registry=r,
        )
        self.kv_cache_usage = Gauge(
            "octavo_kv_cache_usage_ratio", "Fraction of KV cache blocks in use", registry=r
        )
        self.prefix_cache_queries = Counter(
            "octavo_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_cache_hits = Counter(
            "octavo_prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r
        )
        self.spec_decode = SpecDecodeMetrics(r)
        # Last seen cumulative values of the engine core (touched by the engine thread only).
        self._seen_preempted = 0
        self._seen_queries = 0
        self._seen_hits = 0

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
        aborted = any(completion.finish_reason == "abort" for completion in output.outputs)
        self.requests.labels("aborted" if aborted else "finished").inc()
        metrics = output.metrics
        if metrics is None or aborted:
            return
        if metrics.finished_time is not None:
            self.request_latency.observe(metrics.finished_time - metrics.arrival_time)
        if metrics.first_token_time is not None:
            self.time_to_first_token.observe(metrics.first_token_time - metrics.arrival_time)
            num_gaps = metrics.num_generation_tokens - 1
            if num_gaps > 0 and metrics.last_token_time is not None:
                self.inter_token_latency.observe(
                    (metrics.last_token_time - metrics.first_token_time) / num_gaps
                )

    def on_request_failed(self) -> None:
        """A request ended by an engine error."""
        self.requests.labels("failed").inc()

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
    """The ``octavo_spec_decode_*`` counters, fed the scheduler's cumulative SpecDecodeStats."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.num_drafts = Counter(
            "octavo_spec_decode_num_drafts",
            "Speculative decoding: verifications (a request's step with at least one draft)",
            registry=registry,
        )
        self.num_draft_tokens = Counter(
            "octavo_spec_decode_num_draft_tokens",
            "Draft tokens scheduled and verified",
            registry=registry,
        )
        self.num_accepted_tokens = Counter(
            "octavo_spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=registry
        )
        self.num_accepted_tokens_per_pos = Counter(
            "octavo_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0-based)",
            ["position"],
            registry=registry,
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
