"""Perplexity of a model on a fixed text through octavo's own forward pass (its kernels, its
quantized paths), for comparing a checkpoint's formats: bf16 safetensors, ``--quantization
int8``, GGUF Q8_0 / Q4_0 / Q4_K files.

    python benchmarks/perplexity.py MODEL [--tokenizer DIR] [--quantization int8]
        [--text FILE] [--window 512] [--max-windows 16] [--dtype auto]

The text (default: CPython's ``textwrap.py`` from this interpreter's standard library, a file
none of these models is tuned on) is tokenized once and cut into non-overlapping windows of
``--window`` tokens; each window is one prompt, and every token after the window's first is
scored: perplexity = exp(mean negative log-likelihood), as llama.cpp's ``llama-perplexity``
scores its chunks (which scores only each chunk's second half: ``--score-second-half`` does
the same here, to compare with it). The window's hidden states are read from the model's
forward (a forward hook on the model the engine runs), so the numbers are octavo's.
"""

from __future__ import annotations

import argparse
import json
import math
import textwrap
import time

# ruff: noqa: I001 - octavo comes before torch: it sets OMP_WAIT_POLICY before OpenMP loads
import octavo  # noqa: F401
import torch


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--text", default=textwrap.__file__)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--max-windows", type=int, default=16)
    parser.add_argument("--score-second-half", action="store_true")
    parser.add_argument("--json", default=None, help="write the result here too")
    return parser.parse_args(argv)


def window_nll(model, hidden: torch.Tensor, ids: list[int], first: int) -> tuple[float, int]:
    """Summed negative log-likelihood of ``ids[first + 1:]`` given the window's hidden states."""
    logits = model.compute_logits(hidden[first:-1]).float()
    targets = torch.tensor(ids[first + 1 :])
    nll = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
    return float(nll), len(targets)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from octavo import LLM, SamplingParams

    engine_args = dict(max_model_len=args.window + 8, max_num_batched_tokens=args.window + 8)
    for key in ("tokenizer", "quantization"):
        if getattr(args, key) is not None:
            engine_args[key] = getattr(args, key)
    llm = LLM(args.model, dtype=args.dtype, **engine_args)
    model = llm.engine.core.runner.model
    captured: list[torch.Tensor] = []
    model.register_forward_hook(lambda module, inputs, output: captured.append(output))
    ids = llm.get_tokenizer().encode(open(args.text).read())
    windows = [ids[i : i + args.window] for i in range(0, len(ids) - args.window + 1, args.window)][
        : args.max_windows
    ]
    total, count, start = 0.0, 0, time.perf_counter()
    params = SamplingParams(max_tokens=1, temperature=0)
    for window in windows:  # one prompt at a time: its forward is one step of one request
        captured.clear()
        llm.generate([{"prompt_token_ids": window}], params, use_tqdm=False)
        first = len(window) // 2 if args.score_second_half else 0
        nll, n = window_nll(model, captured[0][: len(window)], window, first)
        total, count = total + nll, count + n
    result = {
        "model": args.model,
        "quantization": args.quantization,
        "text": args.text,
        "windows": len(windows),
        "window": args.window,
        "tokens_scored": count,
        "perplexity": math.exp(total / count),
        "seconds": time.perf_counter() - start,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
