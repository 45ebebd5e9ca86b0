"""The serving figures from measured requests, and the sweep flag's validation (no server
needed)."""

from __future__ import annotations

import math

import pytest

from octavo.bench.serve import RequestResult, _parse_sweep, level_figures
from octavo.cli import build_parser


def test_figures_from_known_requests():
    results = [
        RequestResult(prompt_len=10, ttft=0.1, latency=0.5, itl=[0.1, 0.1, 0.2], output_tokens=5),
        RequestResult(prompt_len=20, ttft=0.3, latency=0.3, itl=[], output_tokens=1),
        RequestResult(prompt_len=7, error="HTTP 503: b'full'"),
    ]
    figures = level_figures(results, elapsed=2.0, concurrency=4, peak_rss=None)
    assert (figures["completed"], figures["failed"], figures["errors"]) == (
        2,
        1,
        ["HTTP 503: b'full'"],
    )
    assert (figures["prompt_tokens"], figures["output_tokens"]) == (30, 6)
    assert figures["request_throughput"] == 1.0 and figures["output_throughput"] == 3.0
    assert figures["ttft_p50_ms"] == pytest.approx(200.0) and figures[
        "ttft_mean_ms"
    ] == pytest.approx(200.0)
    assert figures["tpot_p50_ms"] == pytest.approx(
        100.0
    )  # (0.5 - 0.1) / 4; one-token requests have no TPOT
    assert figures["itl_p50_ms"] == pytest.approx(100.0) and figures["itl_p99_ms"] == pytest.approx(
        198.0
    )
    assert figures["e2el_p95_ms"] == pytest.approx(490.0)
    assert "server_peak_rss_mib" not in figures
    empty = level_figures([RequestResult(prompt_len=1, error="x")], 1.0, 1, 2**30)
    assert math.isnan(empty["ttft_p50_ms"]) and empty["server_peak_rss_mib"] == 1024


def test_concurrency_sweep_flag():
    args = build_parser().parse_args(["bench", "serve"])
    assert _parse_sweep(args.max_concurrency) == [1, 10, 50, 100]
    assert math.isinf(args.request_rate) and args.duration is None
    for bad in ("", "0,4", "a,b"):
        with pytest.raises(ValueError, match="--max-concurrency"):
            _parse_sweep(bad)


def test_serve_workload_needs_a_vocabulary_and_reads_sharegpt(tmp_path, bench_model):
    from octavo.bench.serve import _workload

    parser = build_parser()
    with pytest.raises(ValueError, match="--vocab-size"):
        _workload(parser.parse_args(["bench", "serve", "--num-prompts", "2"]))
    requests = _workload(
        parser.parse_args(["bench", "serve", "--tokenizer", str(bench_model), "--num-prompts", "3"])
    )
    assert len(requests) == 3 and all(max(r.prompt_token_ids) < 512 for r in requests)
    path = tmp_path / "sg.json"
    path.write_text(
        '[{"conversations": [{"from": "human", "value": "tell me a long story please"}, '
        '{"from": "gpt", "value": "once upon a time there was"}]}]'
    )
    args = parser.parse_args(
        [
            "bench",
            "serve",
            "--tokenizer",
            str(bench_model),
            "--dataset",
            "sharegpt",
            "--dataset-path",
            str(path),
            "--num-prompts",
            "5",
        ]
    )
    (request,) = _workload(args)
    assert request.output_len >= 4 and len(request.prompt_token_ids) >= 4
