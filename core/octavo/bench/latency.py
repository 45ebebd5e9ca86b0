"""``octavo bench latency``: one batch of identical-shape requests, end to end, with per-step
timing."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from octavo.bench.datasets import random_requests
from octavo.bench.report import SPEC_COLUMNS, print_table, spec_decode_report, summarize, write_json
from octavo.bench.throughput import make_llm
from octavo.config import EngineArgs


def add_latency_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``MODEL``, the batch shape, iteration counts, every engine flag, and ``--output-json``."""
    parser.add_argument("model", help="local HuggingFace model folder")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--output-json", type=Path, default=None)
    EngineArgs.add_cli_args(parser)
    return parser


def run_batch(engine, requests, step_times: list[float]) -> float:
    """Run one batch to completion, appending each engine step's seconds; returns the batch's
    seconds."""
    from octavo.sampling_params import RequestOutputKind, SamplingParams

    for r in requests:
        params = SamplingParams(
            temperature=0.0,
            max_tokens=r.output_len,
            ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        engine.add_request(
            engine.next_request_id(), {"prompt_token_ids": list(r.prompt_token_ids)}, params
        )
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - step_start)
    return time.perf_counter() - start


def main(args: argparse.Namespace) -> int:
    """Warm up, time ``--num-iters`` batches, print the latency and per-step figures."""
    if min(args.batch_size, args.input_len, args.output_len, args.num_iters) < 1:
        raise ValueError("--batch-size, --input-len, --output-len and --num-iters must all be >= 1")
    llm = make_llm(args)
    engine = llm.engine
    requests = random_requests(
        args.batch_size,
        (args.input_len,) * 2,
        (args.output_len,) * 2,
        engine.model_config.vocab_size,
        args.seed,
    )
    for _ in range(args.num_iters_warmup):
        run_batch(engine, requests, [])
    latencies, first_steps, later_steps = [], [], []
    for _ in range(args.num_iters):
        steps: list[float] = []
        latencies.append(run_batch(engine, requests, steps))
        first_steps.append(steps[0])
        later_steps.extend(steps[1:])
    result: dict[str, Any] = {
        "benchmark": "latency",
        "model": args.model,
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_iters": args.num_iters,
        "avg_latency_s": float(np.mean(latencies)),
        **summarize("latency", latencies),
        **summarize("first_step", first_steps),
        **summarize("step", later_steps),
        "steps_per_batch": (len(later_steps) + len(first_steps)) / args.num_iters,
        **spec_decode_report(engine),
    }
    print_table(
        [result],
        [
            "batch_size",
            "input_len",
            "output_len",
            "avg_latency_s",
            "first_step_p50_ms",
            "step_p50_ms",
            "step_p99_ms",
            *(SPEC_COLUMNS if "spec_method" in result else ()),
        ],
    )
    write_json(args.output_json, result)
    return 0
