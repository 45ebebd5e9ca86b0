"""Result figures: percentiles, JSON output, printed tables and ``--plot`` PNG charts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np

PERCENTILES = (50, 95, 99)


def summarize(name: str, values_s: Iterable[float]) -> dict[str, float]:
    """Mean and p50/p95/p99 of ``values_s`` (seconds) as ``{name}_mean_ms``, ``{name}_p50_ms``,
    ..."""
    values = np.asarray(list(values_s), dtype=np.float64) * 1000.0
    if values.size == 0:
        return {
            f"{name}_mean_ms": float("nan"),
            **{f"{name}_p{p}_ms": float("nan") for p in PERCENTILES},
        }
    figures = {f"{name}_mean_ms": float(values.mean())}
    figures.update({f"{name}_p{p}_ms": float(np.percentile(values, p)) for p in PERCENTILES})
    return figures


def write_json(path: Optional[Path], result: dict[str, Any]) -> None:
    """Write ``result`` as indented JSON when a path is given."""
    if path is not None:
        Path(path).write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")


def spec_decode_report(engine: Any) -> dict[str, Any]:
    """Speculative decoding's figures in an ``LLMEngine`` so far (empty when it has none): how
    many drafts were verified, the share accepted, the mean acceptance length (tokens per
    verification) and the acceptance rate at each draft position."""
    if engine.core.args.speculative_config is None:
        return {}
    stats = engine.core.scheduler.spec_stats
    num_drafts = max(stats.num_drafts, 1)
    return {
        "spec_method": engine.core.args.speculative_config.method,
        "spec_num_drafts": stats.num_drafts,
        "spec_num_draft_tokens": stats.num_draft_tokens,
        "spec_num_accepted_tokens": stats.num_accepted_tokens,
        "spec_acceptance_rate": stats.num_accepted_tokens / max(stats.num_draft_tokens, 1),
        "spec_mean_acceptance_length": stats.mean_acceptance_length,
        "spec_acceptance_per_position": [c / num_drafts for c in stats.num_accepted_tokens_per_pos],
    }


SPEC_COLUMNS = ("spec_acceptance_rate", "spec_mean_acceptance_length")


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    """A markdown table of ``columns`` from ``rows``."""
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        cells = [f"{row[c]:,.2f}" if isinstance(row[c], float) else str(row[c]) for c in columns]
        print("| " + " | ".join(cells) + " |")


def plot_serve(runs: Sequence[dict[str, Any]], path: Path) -> list[Path]:
    """Two PNG charts next to ``path``: output throughput and TTFT (p50/p95/p99) against
    concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    concurrency = [r["max_concurrency"] for r in runs]
    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(
        concurrency, [r["output_throughput"] for r in runs], marker="o", label="output tokens/s"
    )
    ax.plot(concurrency, [r["request_throughput"] for r in runs], marker="s", label="requests/s")
    ax.set(
        xlabel="concurrency", ylabel="throughput", title="Throughput vs concurrency", xscale="log"
    )
    ax.legend()
    written.append(path.with_name(path.stem + "_throughput.png"))
    fig.savefig(written[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for p in PERCENTILES:
        ax.plot(concurrency, [r[f"ttft_p{p}_ms"] for r in runs], marker="o", label=f"TTFT p{p}")
    ax.set(
        xlabel="concurrency", ylabel="ms", title="Time to first token vs concurrency", xscale="log"
    )
    ax.legend()
    written.append(path.with_name(path.stem + "_ttft.png"))
    fig.savefig(written[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)
    return written
