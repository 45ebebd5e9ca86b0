"""Decode throughput of a model family's own kernels, end to end through ``LLM.generate``:

    .venv/bin/python benchmarks/family_decode.py --model moe [--batch 1 8] [--prompt-len 128]
        [--output-len 64] [--repeats 3]
    .venv/bin/python benchmarks/family_decode.py --model mla [--batch 1 8] [--prompt-len 1024]

``moe`` (benchmarks/models.py: a tiny Qwen3-MoE, 16 experts, 4 per token): the platform's fused
MoE (``octavo_fused_moe``: the cpu platform's compiled kernel) against octavo.ops.reference's
loop over the step's experts, the same engine with each layer's experts re-packed by the
reference after load. ``mla`` (a dense DeepSeek-V3 at its latent widths): latent attention's
absorbed form against the expanded one (``OCTAVO_MLA_FORM``), and ``auto``.

Every variant's engine is built first, then measured round-robin (drift slows all alike). A
measurement generates ``batch`` prompts of ``--prompt-len`` random tokens twice: one token
(the prefill) and ``1 + --output-len`` tokens (EOS ignored); decode tokens per second is
``batch * output_len`` over the difference. The table gives the median of ``--repeats``.
Greedy outputs of the variants are compared (they compute the same function).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# ruff: noqa: I001 - octavo comes before torch: it sets OMP_WAIT_POLICY before OpenMP loads
import octavo  # noqa: F401
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import MODEL_DTYPES, make_model  # noqa: E402

from octavo import LLM, SamplingParams  # noqa: E402
from octavo.models.layers.fused_moe import FusedExperts  # noqa: E402
from octavo.ops import reference  # noqa: E402

VARIANTS = {"moe": ("compiled", "reference"), "mla": ("absorbed", "expanded", "auto")}


def cpu_name() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def build(model: str, variant: str, folder: Path, args) -> LLM:
    """The engine of one variant (MLA's form is read at load, from the environment)."""
    if model == "mla":
        os.environ["OCTAVO_MLA_FORM"] = variant
    llm = LLM(
        str(folder),
        dtype=str(MODEL_DTYPES[model]).removeprefix("torch."),
        max_model_len=args.prompt_len + args.output_len + 8,
        max_num_seqs=max(args.batch),
        enable_prefix_caching=False,
        kv_cache_memory=2 << 30,
        seed=0,
    )
    os.environ.pop("OCTAVO_MLA_FORM", None)
    if variant == "reference":
        runner_model = llm.engine.core.runner.model
        for layer in runner_model.modules():
            if isinstance(layer, FusedExperts):
                w13, w2 = layer.w13_weight.detach(), layer.w2_weight.detach()
                layer._fn = reference.pack_fused_moe(layer.spec, w13, w2)
    return llm


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]} for _ in range(batch)
    ]


def timed(llm: LLM, batch_prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(batch_prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]


def measure(llm: LLM, batch_prompts, output_len: int) -> tuple[float, float, list]:
    """(prefill seconds, decode tokens per second, the greedy tokens)."""
    prefill, _ = timed(llm, batch_prompts, 1)
    full, tokens = timed(llm, batch_prompts, 1 + output_len)
    return prefill, len(batch_prompts) * output_len / max(full - prefill, 1e-9), tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(VARIANTS), required=True)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--folder", type=Path, default=None, help="where the model is written")
    args = parser.parse_args()
    folder = args.folder or Path(tempfile.gettempdir()) / f"octavo-bench-{args.model}"
    folder = make_model(args.model, folder)
    vocab = int(json.loads((folder / "config.json").read_text())["vocab_size"])
    engines = {v: build(args.model, v, folder, args) for v in VARIANTS[args.model]}
    results = {}  # (variant, batch) -> ([prefill s], [decode tok/s])
    tokens = {}
    for batch in args.batch:
        batch_prompts = prompts(batch, args.prompt_len, vocab, seed=batch)
        for name, llm in engines.items():  # warm-up: first-call allocations, thread pools
            timed(llm, batch_prompts[:1], 2)
        for repeat in range(args.repeats):
            order = list(engines) if repeat % 2 == 0 else list(reversed(engines))
            for name in order:
                prefill, decode, out = measure(engines[name], batch_prompts, args.output_len)
                row = results.setdefault((name, batch), ([], []))
                row[0].append(prefill)
                row[1].append(decode)
                tokens[(name, batch)] = out
    print(f"\n{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(" ".join(sys.argv))
    head = f"prefill ({args.prompt_len} tokens) ms"
    print(f"\n| variant | batch | {head} | decode tok/s | same tokens |")
    print("|---|---|---|---|---|")
    first = VARIANTS[args.model][0]
    for (name, batch), (prefill, decode) in results.items():
        same = tokens[(name, batch)] == tokens[(first, batch)]
        print(
            f"| {name} | {batch} | {statistics.median(prefill) * 1e3:.1f} | "
            f"{statistics.median(decode):.1f} | {'yes' if same else 'no'} |"
        )


if __name__ == "__main__":
    main()
