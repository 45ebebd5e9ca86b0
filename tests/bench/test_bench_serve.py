"""``octavo bench serve`` and ``startup`` against a real ``octavo serve`` subprocess on a free
port."""

from __future__ import annotations

import json

import pytest

from octavo.bench.startup import start_server, stop_server
from octavo.cli import main

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
# Starting a server process takes 10-80 s on the shared 2-core machine (imports, model load).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(bench_model):
    """A real ``octavo serve`` process; its start-up time is what ``bench startup`` measures."""
    process, base_url, seconds = start_server(
        str(bench_model),
        ["--kv-cache-memory", "8MiB", "--max-num-seqs", "16", "--max-num-batched-tokens", "256"],
        timeout=180,
    )
    yield process, base_url, seconds
    stop_server(process)


def test_startup_time_is_positive_and_the_server_answers(server):
    process, _, seconds = server
    assert seconds > 0 and process.poll() is None


def test_bench_serve_sweeps_concurrency_and_reports_figures(server, bench_model, tmp_path, capsys):
    process, base_url, _ = server
    out, plot = tmp_path / "serve.json", tmp_path / "serve.png"
    argv = [
        "bench",
        "serve",
        "--base-url",
        base_url,
        "--tokenizer",
        str(bench_model),
        "--max-concurrency",
        "1,4",
        "--num-prompts",
        "8",
        "--input-len",
        "8",
        "16",
        "--output-len",
        "6",
        "6",
        "--disable-tqdm",
        "--server-pid",
        str(process.pid),
        "--output-json",
        str(out),
        "--plot",
        str(plot),
    ]
    assert main(argv) == 0
    assert "ttft_p50_ms" in capsys.readouterr().out
    runs = json.loads(out.read_text())["runs"]
    assert [r["max_concurrency"] for r in runs] == [1, 4]
    for run in runs:
        assert (run["completed"], run["failed"], run["output_tokens"]) == (8, 0, 48)
        assert (
            0 < run["ttft_p50_ms"] <= run["ttft_p95_ms"] <= run["ttft_p99_ms"] < run["e2el_p99_ms"]
        )
        # Tokens that reach the client in one read share a timestamp: on a fast host most of a
        # 6-token stream's gaps can be 0, so the median gap is only >= 0; TPOT spans the stream.
        assert run["itl_p50_ms"] >= 0 and run["tpot_p50_ms"] > 0
        assert run["request_throughput"] > 0 and run["output_throughput"] == pytest.approx(
            48 / run["duration_s"]
        )
        assert run["server_peak_rss_mib"] > 10
    assert (tmp_path / "serve_throughput.png").stat().st_size > 0 and (
        tmp_path / "serve_ttft.png"
    ).stat().st_size > 0


def test_bench_serve_duration_bounds_the_requests(server, bench_model, tmp_path):
    _, base_url, _ = server
    out = tmp_path / "serve.json"
    argv = [
        "bench",
        "serve",
        "--base-url",
        base_url,
        "--vocab-size",
        "512",
        "--max-concurrency",
        "1",
        "--num-warmups",
        "0",
        "--num-prompts",
        "50",
        "--input-len",
        "8",
        "8",
        "--output-len",
        "4",
        "4",
        "--duration",
        "0.5",
        "--request-rate",
        "20",
        "--disable-tqdm",
        "--output-json",
        str(out),
    ]
    assert main(argv) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert 1 <= run["completed"] < 50 and run["failed"] == 0
