"""``octavo bench throughput``: offline, in-process throughput of ``LLM.generate`` on a workload."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Sequence

from octavo.bench.datasets import BenchRequest, add_dataset_args, load_requests
from octavo.bench.report import SPEC_COLUMNS, print_table, spec_decode_report, write_json
from octavo.config import EngineArgs


def add_throughput_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``MODEL``, the dataset flags, every engine flag, and the output flags."""
    parser.add_argument("model", help="local HuggingFace model folder")
    add_dataset_args(parser)
    parser.add_argument("--output-json", type=Path, default=None, help="write the results here")
    parser.add_argument("--disable-tqdm", action="store_true")
    EngineArgs.add_cli_args(parser)
    return parser


def make_llm(args: argparse.Namespace):
    """An ``LLM`` from the engine flags in ``args``."""
    import dataclasses

    from octavo import LLM

    engine_args = EngineArgs.from_cli_args(args, model=args.model)
    return LLM(**{f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)})


def run_throughput(
    llm, requests: Sequence[BenchRequest], use_tqdm: bool = False, keep_token_ids: bool = False
) -> dict[str, Any]:
    """Generate every request greedily with EOS ignored; the throughput figures of that one run
    (plus each request's output ``token_ids`` when ``keep_token_ids``)."""
    from octavo import SamplingParams

    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests
    ]
    start = time.perf_counter()
    outputs = llm.generate(
        [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests],
        params,
        use_tqdm=use_tqdm,
    )
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {
        "num_requests": len(requests),
        "elapsed_s": elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(requests) / elapsed,
        "output_throughput": output_tokens / elapsed,
        "total_token_throughput": (prompt_tokens + output_tokens) / elapsed,
    }
    if keep_token_ids:
        result["token_ids"] = [list(o.outputs[0].token_ids) for o in outputs]
    return result


def main(args: argparse.Namespace) -> int:
    """Load the model, build the workload, run it once, print and optionally write the figures."""
    start = time.perf_counter()
    llm = make_llm(args)
    load_s = time.perf_counter() - start
    engine = llm.engine
    requests = load_requests(
        args,
        engine.model_config.vocab_size,
        encode=engine.tokenizer.encode,
        max_len=engine.model_config.max_model_len,
    )
    result = {
        "benchmark": "throughput",
        "model": args.model,
        "dataset": args.dataset,
        "load_s": load_s,
        **run_throughput(llm, requests, use_tqdm=not args.disable_tqdm),
    }
    result.update(spec_decode_report(engine))
    print_table(
        [result],
        [
            "num_requests",
            "elapsed_s",
            "request_throughput",
            "output_throughput",
            "total_token_throughput",
            *(SPEC_COLUMNS if "spec_method" in result else ()),
        ],
    )
    write_json(args.output_json, result)
    return 0
