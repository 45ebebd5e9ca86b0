"""Time the linear layers of the benchmark models four ways on the host CPU: torch's matmul
(``F.linear``), oneDNN with the weight reordered once (``mkldnn._linear_pointwise``), MKL
with the weight packed once (``mkl._mkl_linear``, fp32 only), and the cpu platform's compiled
GEMM over its packed column panels (``compiled``: float32 arithmetic, so for bf16 it is the
widened product a host without native bf16 runs).

    .venv/bin/python benchmarks/cpu_gemm.py [--model tiny small] [--tokens 1 16 128 1024]
        [--repeats 9] [--threads N] [--whole-model [--compiled-only]] [--dtype float32]

Shapes are each model's projections (qkv, o, gate_up, down, lm_head) at the given numbers of
tokens per step. Variants are timed round-robin and the median of ``--repeats`` rounds is
printed in microseconds, with each variant's speed-up over F.linear. Each layer alone is timed
with its weight hot in cache; ``--whole-model`` times one pass over all of a model's layers
instead (every layer's own weights, in order, as a forward step reads them: a model larger
than the cache streams them from memory). The four variants' weights together are four times a
model's; ``--compiled-only`` keeps the compiled GEMM's alone, so that a model whose weights fit
the last-level cache is timed from there, as the engine runs it.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

# ruff: noqa: I001 - octavo comes before torch: it sets OMP_WAIT_POLICY before OpenMP loads
import octavo  # noqa: F401
import torch
import torch.nn.functional as F
from models import MODEL_DTYPES, MODEL_SPECS  # benchmarks/models.py

from octavo_cpu.gemm import compiled_packer


def projections(spec) -> dict[str, tuple[int, int]]:
    """``name -> (in_features, out_features)`` of one model's linear layers."""
    head_dim = spec.hidden_size // spec.num_attention_heads
    qkv = (spec.num_attention_heads + 2 * spec.num_key_value_heads) * head_dim
    h, i = spec.hidden_size, spec.intermediate_size
    return {
        "qkv": (h, qkv),
        "o": (spec.num_attention_heads * head_dim, h),
        "gate_up": (h, 2 * i),
        "down": (i, h),
        "lm_head": (h, spec.vocab_size),
    }


def variants(weight: torch.Tensor, x: torch.Tensor) -> dict:
    """The ways to compute ``x @ weight.T`` this torch build offers for ``weight.dtype``."""
    out = {"F.linear": lambda: F.linear(x, weight)}
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, x.shape[0])
    out["onednn packed"] = lambda: torch.ops.mkldnn._linear_pointwise(
        x, packed, None, "none", [], ""
    )
    if weight.dtype == torch.float32:
        mkl_packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, x.shape[0])
        out["mkl packed"] = lambda: torch.ops.mkl._mkl_linear(
            x, mkl_packed, weight, None, x.shape[0]
        )
    pack = compiled_packer(weight.dtype, widened=(weight.dtype,))
    if pack is not None:
        out["compiled"] = functools.partial(pack(weight), x)
    return out


def time_round_robin(fns: dict, repeats: int, inner: int) -> dict[str, float]:
    """Median microseconds per call of each variant."""
    for fn in fns.values():
        fn()
    times: dict[str, list] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - start) / inner * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def whole_model(
    model: str, dtype: torch.dtype, tokens: int, repeats: int, only: str | None = None
) -> dict[str, float]:
    """Median microseconds of one pass over all of ``model``'s linear layers, per variant (or
    the variant ``only`` alone, the others dropped before timing)."""
    spec = MODEL_SPECS[model]
    shapes = list(projections(spec).items())
    layers = [(k, n) for name, (k, n) in shapes if name != "lm_head"] * spec.num_hidden_layers
    layers.append(projections(spec)["lm_head"])
    per_layer = [
        variants(torch.randn(n, k, dtype=dtype) / k**0.5, torch.randn(tokens, k, dtype=dtype))
        for k, n in layers
    ]
    if only is not None:
        if only not in per_layer[0]:
            raise SystemExit(f"no {only!r} GEMM for {dtype} here (variants: {list(per_layer[0])})")
        per_layer = [{only: fns[only]} for fns in per_layer]
    names = list(per_layer[0])
    passes = {name: (lambda name=name: [fns[name]() for fns in per_layer]) for name in names}
    return time_round_robin(passes, repeats, 1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", nargs="+", default=["tiny", "small"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 128, 1024])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--whole-model", action="store_true", help="time passes over all layers")
    parser.add_argument(
        "--compiled-only", action="store_true", help="--whole-model: the compiled GEMM alone"
    )
    parser.add_argument("--dtype", default=None, help="instead of the model's (float32, bfloat16)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.whole_model:
        print("| model | dtype | tokens | variant | ms per pass | vs F.linear |")
        print("|---|---|---|---|---|---|")
        only = "compiled" if args.compiled_only else None
        for model in args.model:
            dtype = getattr(torch, args.dtype) if args.dtype else MODEL_DTYPES[model]
            for tokens in args.tokens:
                result = whole_model(model, dtype, tokens, args.repeats, only)
                for name, us in result.items():
                    speedup = f"{result['F.linear'] / us:.2f}x" if "F.linear" in result else ""
                    print(
                        f"| {model} | {str(dtype)[6:]} | {tokens} | {name} | {us / 1e3:.2f} | "
                        f"{speedup} |"
                    )
        return
    print("| model | dtype | layer | tokens | variant | us | vs F.linear |")
    print("|---|---|---|---|---|---|---|")
    for model in args.model:
        spec, dtype = MODEL_SPECS[model], MODEL_DTYPES[model]
        for layer, (k, n) in projections(spec).items():
            weight = torch.randn(n, k, dtype=dtype) / k**0.5
            for tokens in args.tokens:
                x = torch.randn(tokens, k, dtype=dtype)
                fns = variants(weight, x)
                reference = fns["F.linear"]().float()
                for name, fn in fns.items():
                    err = (fn().float() - reference).abs().max().item()
                    assert err < 1e-2 * reference.abs().max().item() + 1e-3, (name, err)
                inner = max(1, 2000 // (tokens * max(1, n * k // 100_000)))
                result = time_round_robin(fns, args.repeats, inner)
                base = result["F.linear"]
                for name, us in result.items():
                    print(
                        f"| {model} | {str(dtype)[6:]} | {layer} | {tokens} | {name} | {us:.1f} | "
                        f"{base / us:.2f}x |"
                    )


if __name__ == "__main__":
    main()
