"""benchmarks/compare's timed passes (``--repeats``): an offline figure is the median of the
passes, the outputs compared are the first pass's, and each pass draws prompts of its own."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

COMPARE = Path(__file__).resolve().parent.parent.parent / "benchmarks" / "compare"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"compare_{name}", COMPARE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def worker():
    return _load("offline_worker")


@pytest.fixture(scope="module")
def run():
    before = list(sys.path)
    try:
        return _load("run")
    finally:
        sys.path[:] = before


def test_the_figure_is_the_median_pass_and_the_tokens_the_first(worker):
    seconds = iter([99.0, 4.0, 9.0, 5.0])  # the warm-up, then three timed passes
    calls = []

    def generate(prompts, output_len):
        calls.append(prompts)
        return [[len(calls)] * output_len for _ in prompts], next(seconds)

    spec = {"prompts": [[1, 2]], "more_prompts": [[[3, 4]], [[5, 6]]], "output_len": 3}
    result = worker.timed(generate, spec)
    assert calls == [[worker.WARMUP_PROMPT], [[1, 2]], [[3, 4]], [[5, 6]]]
    assert result["pass_seconds"] == [4.0, 9.0, 5.0]
    assert result["seconds"] == 5.0
    assert result["tokens"] == [[2, 2, 2]]  # the first timed pass's (call 2)
    assert result["output_tokens"] == 3


def test_one_pass_without_more_prompts(worker):
    times = iter([1.0, 7.0])
    result = worker.timed(
        lambda p, n: ([[0] * n for _ in p], next(times)), {"prompts": [[1]], "output_len": 2}
    )
    assert result["seconds"] == 7.0 and result["pass_seconds"] == [7.0]


def test_a_pass_with_another_token_count_is_refused(worker):
    outputs = iter([([[0]], 1.0), ([[0, 0]], 2.0), ([[0]], 3.0)])
    spec = {"prompts": [[1]], "more_prompts": [[[2]]], "output_len": 2}
    with pytest.raises(RuntimeError, match="another number of output tokens"):
        worker.timed(lambda p, n: next(outputs), spec)


def test_further_passes_draw_their_own_prompts(run):
    args = run.parse_args(["--repeats", "3", "--seed", "7"])
    seeds = []

    def make_requests(seed):
        seeds.append(seed)
        return run.random_requests(4, (8, 16), (2, 2), 100, seed)

    first = [list(r.prompt_token_ids) for r in make_requests(args.seed)]
    more = run.further_passes(make_requests, args)
    assert seeds == [7, 7 + run.PASS_SEED_STRIDE, 7 + 2 * run.PASS_SEED_STRIDE]
    assert len(more) == 2 and all(len(p) == len(first) for p in more)
    assert first not in more and more[0] != more[1]


def test_repeats_below_one_are_refused(run, capsys):
    with pytest.raises(SystemExit):
        run.parse_args(["--repeats", "0"])
    assert "--repeats must be >= 1" in capsys.readouterr().err
