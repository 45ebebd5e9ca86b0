"""Offline throughput: octavo's ``LLM.generate`` against transformers ``generate`` with static
batches, on the same random-weight model and the same workload, side by side in one run.

    python benchmarks/throughput.py --size small                 # the issue's standard workload
    python benchmarks/throughput.py --size tiny --num-requests 32 --output-len 32   # quick look

Workload (PEERS.md): N token-id prompts with lengths uniform in [min, max] (seeded, from
``octavo.bench.datasets.random_requests``, as ``octavo bench throughput --dataset random``), a
fixed number of output tokens each, greedy, EOS ignored.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

# ruff: noqa: I001 - octavo comes before torch: it sets OMP_WAIT_POLICY before OpenMP loads
import octavo  # noqa: F401
import torch
from models import MODEL_DTYPES, make_model

from octavo.bench.datasets import BenchRequest, random_requests
from octavo.bench.throughput import run_throughput


def workload(
    num_requests: int, min_len: int, max_len: int, output_len: int, vocab_size: int, seed: int
) -> list[BenchRequest]:
    return random_requests(
        num_requests, (min_len, max_len), (output_len, output_len), vocab_size, seed
    )


def run_octavo(model: Path, requests: list[BenchRequest], dtype: str, args) -> dict:
    from octavo import LLM

    start = time.perf_counter()
    llm = LLM(
        str(model),
        dtype=dtype,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    load_s = time.perf_counter() - start
    result = run_throughput(llm, requests, keep_token_ids=True)
    return {
        "engine": "octavo",
        "seconds": result["elapsed_s"],
        "output_tokens": result["output_tokens"],
        "load_seconds": load_s,
        "tokens": result["token_ids"],
    }


@torch.inference_mode()
def run_transformers(
    model: Path, prompts, output_len: int, dtype: torch.dtype, batch_size: int
) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype).eval()
    start = time.perf_counter()
    tokens = []
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            eos_token_id=None,
            pad_token_id=0,
        )
        tokens += out[:, width:].tolist()
    elapsed = time.perf_counter() - start
    return {
        "engine": f"transformers (static batches of {batch_size})",
        "seconds": elapsed,
        "output_tokens": sum(len(t) for t in tokens),
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", choices=["tiny", "small"], default="small")
    parser.add_argument(
        "--model", type=Path, default=None, help="an existing model folder (default: make one)"
    )
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--input-len", type=int, nargs=2, default=(64, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument(
        "--hf-num-requests",
        type=int,
        default=None,
        help="run transformers on the first N requests only",
    )
    parser.add_argument("--kv-cache-memory", default="4GiB")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()

    model = args.model or make_model(
        args.size, Path(tempfile.gettempdir()) / f"octavo-bench-{args.size}"
    )
    config = json.loads((model / "config.json").read_text())
    dtype = MODEL_DTYPES.get(args.size, torch.float32)
    requests = workload(
        args.num_requests, *args.input_len, args.output_len, config["vocab_size"], args.seed
    )
    prompts = [list(r.prompt_token_ids) for r in requests]
    print(
        f"model {model} ({args.size}, {dtype}), {len(prompts)} requests, "
        f"prompts {args.input_len[0]}-{args.input_len[1]}, "
        f"{args.output_len} output tokens, torch threads {torch.get_num_threads()}"
    )
    results = [run_octavo(model, requests, str(dtype).removeprefix("torch."), args)]
    if not args.skip_transformers:
        hf_prompts = prompts[: args.hf_num_requests or len(prompts)]
        results.append(
            run_transformers(model, hf_prompts, args.output_len, dtype, args.hf_batch_size)
        )
        same = sum(a == b for a, b in zip(results[0]["tokens"], results[1]["tokens"]))
        print(f"greedy outputs identical for {same}/{len(hf_prompts)} requests")
    base = results[-1]["output_tokens"] / results[-1]["seconds"]
    print("\n| engine | requests | output tok/s | seconds | vs last |\n|---|---|---|---|---|")
    for r in results:
        rate = r["output_tokens"] / r["seconds"]
        print(
            f"| {r['engine']} | {len(r['tokens'])} | {rate:,.0f} | {r['seconds']:.1f} "
            f"| x{rate / base:.2f} |"
        )
    if args.json:
        args.json.write_text(
            json.dumps([{k: v for k, v in r.items() if k != "tokens"} for r in results], indent=2)
        )


if __name__ == "__main__":
    main()
