"""Multi-LoRA serving against the base model alone, on the real model (benchmarks/real_model.py's
SmolLM2-135M-Instruct), measured by ``octavo bench serve`` (streaming /v1/completions, random
token-id prompts), configurations alternated round by round:

- ``base``: ``octavo serve MODEL`` without LoRA, every request for the base model;
- ``lora-server base``: the same with ``--enable-lora`` and the adapters loaded, every request for
  the base model (what serving adapters costs requests that use none);
- ``4 adapters``: that server, request i for adapter i mod 4 (every batch mixes them).

    python benchmarks/lora_serve.py [--format bf16] [--rank 16] [--concurrency 32]
        [--rounds 2] [--num-prompts 64] [--input-len 128 256] [--output-len 64]

The adapters are random rank-``--rank`` PEFT adapters of every projection (q, k, v, o, gate,
up, down), made once with PEFT into benchmarks/.models/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import real_model_serve  # noqa: E402
from real_model_serve import MODEL, start  # noqa: E402

NUM_ADAPTERS = 4
CONFIGS = ("base", "lora-server base", "4 adapters")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", default="bf16", help="bf16 (the HF folder) or a GGUF type")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--concurrency", default="32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=(128, 256))
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def adapters(rank: int) -> list[Path]:
    """The benchmark's adapters, made with PEFT the first time."""
    from octavo.testing.tiny_lora import write_random_lora

    folders = [HERE / ".models" / f"smollm2-135m-lora-r{rank}-{i}" for i in range(NUM_ADAPTERS)]
    for i, folder in enumerate(folders):
        if not (folder / "adapter_model.safetensors").is_file():
            write_random_lora(folder, MODEL / "hf", rank=rank, alpha=2 * rank, std=0.02, seed=i)
    return folders


def lora_flags(folders: list[Path], rank: int) -> list[str]:
    modules = [f"lora{i}={folder}" for i, folder in enumerate(folders)]
    flags = ["--enable-lora", "--max-loras", str(NUM_ADAPTERS), "--max-lora-rank", str(rank)]
    return flags + ["--lora-modules", *modules]


def sweep(port: int, pid: int, args, lora_modules: str = "") -> dict:
    extra = ["--num-warmups", str(NUM_ADAPTERS)]
    extra += ["--lora-modules", lora_modules] if lora_modules else []
    return real_model_serve.sweep("octavo", port, pid, args, extra)


def run_round(args, folders: list[Path], context: int, runs: dict) -> None:
    names = ",".join(f"lora{i}" for i in range(NUM_ADAPTERS))
    with open(os.devnull, "w") as log:
        for with_lora in (False, True):
            extra = lora_flags(folders, args.rank) if with_lora else []
            process, port = start("octavo", args.format, 0, context, log, extra)
            try:
                if with_lora:
                    runs.setdefault(CONFIGS[1], []).append(sweep(port, process.pid, args))
                    runs.setdefault(CONFIGS[2], []).append(sweep(port, process.pid, args, names))
                else:
                    runs.setdefault(CONFIGS[0], []).append(sweep(port, process.pid, args))
            finally:
                process.terminate()
                process.wait(timeout=30)


def main(argv=None) -> None:
    args = parse_args(argv)
    folders = adapters(args.rank)
    context = -(-(args.input_len[1] + args.output_len) // 256) * 256
    runs: dict = {}
    for round_index in range(args.rounds):
        run_round(args, folders, context, runs)
        print(f"round {round_index} done", flush=True)
    print_table(runs, [int(c) for c in args.concurrency.split(",")])
    if args.out:
        args.out.write_text(json.dumps(runs, indent=2))


def print_table(runs: dict, levels: list[int]) -> None:
    print("| configuration | " + " | ".join(f"c={c} tok/s, ITL p50, TTFT p50" for c in levels))
    print("|---|" + "---|" * len(levels))
    for config in CONFIGS:
        cells = []
        for level in levels:
            rows = [r for res in runs[config] for r in res["runs"] if r["max_concurrency"] == level]
            tok_s = statistics.median(r["output_throughput"] for r in rows)
            itl = statistics.median(r["itl_p50_ms"] for r in rows)
            ttft = statistics.median(r["ttft_p50_ms"] for r in rows)
            cells.append(f"{tok_s:.0f}, {itl:.2f} ms, {ttft:.0f} ms")
        print(f"| {config} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
