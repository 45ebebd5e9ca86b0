"""Plot output tokens a second against concurrency, one line per engine (and format), from the
results of benchmarks/compare/run.py (``results.json``) and benchmarks/real_model_serve.py
(``--out FILE``).

    .venv/bin/python benchmarks/plot_serving.py OUT.png RESULTS.json[::NOTE] [...]
        [--title TEXT]

Each file may be either kind; every serving level in it becomes a point (real_model_serve.py's
rounds give the median of each level). ``::NOTE`` adds NOTE to the labels of that file's lines
(two runs of one engine under different settings).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def levels_of_runs(runs: list[dict]) -> dict[int, float]:
    """``{concurrency: output tok/s}`` of one ``octavo bench serve`` result's runs."""
    return {run["max_concurrency"]: run["output_throughput"] for run in runs}


def series(path: Path) -> dict[str, dict[int, float]]:
    """``{label: {concurrency: output tok/s}}`` of one results file."""
    data = json.loads(path.read_text())
    lines: dict[str, dict[int, float]] = {}
    if "serve" in data:  # benchmarks/compare/run.py
        for workload in data["serve"]:
            for engine, row in workload["rows"].items():
                label = f"{engine} ({workload['dtype']})"
                lines.setdefault(label, {}).update(levels_of_runs(row.get("runs", [])))
        return lines
    for label, rounds in data.items():  # benchmarks/real_model_serve.py: label -> rounds
        per_level = defaultdict(list)
        for bench in rounds:
            for level, value in levels_of_runs(bench["runs"]).items():
                per_level[level].append(value)
        lines[label] = {level: statistics.median(v) for level, v in per_level.items()}
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("results", nargs="+")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, dict[int, float]] = {}
    for arg in args.results:
        path, _, note = str(arg).partition("::")
        for label, points in series(Path(path)).items():
            lines[f"{label} {note}".strip()] = points
    if not lines:
        raise SystemExit(f"no serving levels in {', '.join(map(str, args.results))}")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, points in sorted(lines.items()):
        levels = sorted(points)
        ax.plot(levels, [points[c] for c in levels], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(args.title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
