"""``octavo bench throughput`` and ``octavo bench latency`` on a tiny model, through the real
CLI."""

from __future__ import annotations

import json

from octavo.cli import main

ENGINE = ["--kv-cache-memory", "8MiB", "--max-num-seqs", "16", "--max-num-batched-tokens", "256"]


def test_bench_throughput_prints_and_writes_json(bench_model, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    argv = [
        "bench",
        "throughput",
        str(bench_model),
        "--num-prompts",
        "6",
        "--input-len",
        "8",
        "24",
        "--output-len",
        "5",
        "5",
        "--disable-tqdm",
        "--output-json",
        str(out),
        *ENGINE,
    ]
    assert main(argv) == 0
    assert "output_throughput" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert (
        result["num_requests"] == 6 and result["output_tokens"] == 30
    )  # EOS ignored: every request gives 5
    assert 8 * 6 <= result["prompt_tokens"] <= 24 * 6
    assert result["output_throughput"] > 0 and result["elapsed_s"] > 0
    assert abs(result["output_throughput"] - result["output_tokens"] / result["elapsed_s"]) < 1e-6


def test_bench_prefix_dataset_runs_offline(bench_model, tmp_path):
    out = tmp_path / "prefix.json"
    argv = [
        "bench",
        "throughput",
        str(bench_model),
        "--dataset",
        "prefix",
        "--prefix-len",
        "32",
        "--num-prompts",
        "4",
        "--input-len",
        "4",
        "4",
        "--output-len",
        "2",
        "2",
        "--disable-tqdm",
        "--output-json",
        str(out),
        *ENGINE,
    ]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["prompt_tokens"] == 4 * 36 and result["output_tokens"] == 8


def test_bench_latency_times_every_step(bench_model, tmp_path):
    out = tmp_path / "latency.json"
    argv = [
        "bench",
        "latency",
        str(bench_model),
        "--batch-size",
        "3",
        "--input-len",
        "10",
        "--output-len",
        "6",
        "--num-iters",
        "2",
        "--output-json",
        str(out),
        *ENGINE,
    ]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    # one prefill step that also samples the first token, then one step per further token
    assert result["steps_per_batch"] == 6
    assert 0 < result["step_p50_ms"] <= result["step_p99_ms"]
    assert result["latency_p50_ms"] > result["first_step_p50_ms"]


def test_bench_throughput_and_latency_report_acceptance_with_speculation(
    bench_model, tmp_path, capsys
):
    spec = json.dumps(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}
    )
    out = tmp_path / "throughput.json"
    argv = ["bench", "throughput", str(bench_model), "--num-prompts", "6", "--input-len", "8",
            "24", "--output-len", "24", "24", "--disable-tqdm", "--output-json", str(out),
            "--speculative-config", spec, *ENGINE]  # fmt: skip
    assert main(argv) == 0
    assert "spec_mean_acceptance_length" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["output_tokens"] == 6 * 24 and result["spec_method"] == "ngram"
    assert result["spec_num_draft_tokens"] >= result["spec_num_accepted_tokens"] > 0
    assert result["spec_mean_acceptance_length"] == 1 + (
        result["spec_num_accepted_tokens"] / result["spec_num_drafts"]
    )
    out = tmp_path / "latency.json"
    argv = ["bench", "latency", str(bench_model), "--batch-size", "2", "--input-len", "8",
            "--output-len", "16", "--num-iters", "1", "--num-iters-warmup", "0",
            "--output-json", str(out), "--speculative-config", spec, *ENGINE]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(out.read_text())["spec_num_drafts"] > 0
