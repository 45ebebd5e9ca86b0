"""One decode step and one prefill: octavo's paged runner against transformers' dense forward.

    python benchmarks/forward.py                      # ~100M Llama, float32 and bfloat16
    python benchmarks/forward.py --dtypes bfloat16 --reps 5
    python benchmarks/forward.py --tiny               # seconds-long smoke run

Both sides use the same random-weight checkpoint. The decode step is ``--decode-batch``
requests each with ``--context`` tokens of context (one new token each; transformers gets a
dense KV cache of the same length); the prefill is ``--prefill-batch`` fresh prompts of
``--prefill-len`` tokens. octavo's figure is a whole ``ModelRunner.execute_model`` step (input
preparation, forward, logits of the last tokens, greedy sampling); transformers' is one
``model(...)`` call with ``logits_to_keep=1``. The two run alternately (the machine may be
shared); medians of ``--reps`` timed runs after ``--warmup`` untimed ones.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

# ruff: noqa: I001 - octavo comes before torch: it sets OMP_WAIT_POLICY before OpenMP loads
import octavo  # noqa: F401
import torch

from octavo.model_executor.batch_runner import RunnerConfig
from octavo.model_executor.model_config import ModelConfig
from octavo.model_executor.model_runner import ModelRunner
from octavo.platform import Platform
from octavo.sampling_params import SamplingParams
from octavo.sched.output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from octavo.testing.tiny_models import TinyModelSpec, write_tiny_model

SMALL_LLAMA = TinyModelSpec(
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    intermediate_size=2048,
    vocab_size=32000,
    max_position_embeddings=2048,
)
TINY_LLAMA = TinyModelSpec(max_position_embeddings=2048)
GREEDY = SamplingParams(temperature=0.0)
BLOCK_SIZE = 16


def interleaved(ours, theirs, reps: int, warmup: int) -> tuple[float, float]:
    """Median wall times (ms) of ``ours()`` and ``theirs()``, run alternately so that a busy
    shared machine slows both alike; ``warmup`` untimed calls of each first."""
    for _ in range(warmup):
        ours()
        theirs()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for fn, bucket in ((ours, times[0]), (theirs, times[1])):
            start = time.perf_counter()
            fn()
            bucket.append(time.perf_counter() - start)
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=generator).tolist()


def octavo_steps(path: Path, dtype: str, args):
    """(decode, prefill) callables: one step each of octavo's runner on the cpu platform."""
    platform = Platform.select(device="cpu")
    config = ModelConfig.from_folder(
        path, dtype=dtype, supported_dtypes=platform.capabilities.dtypes
    )
    max_tokens = max(args.decode_batch, args.prefill_batch * args.prefill_len)
    runner = ModelRunner(
        config,
        platform,
        RunnerConfig(BLOCK_SIZE, max(args.decode_batch, args.prefill_batch), max_tokens),
    )
    decode_len = args.context + args.warmup + args.reps + 1  # the context grows a token a step
    blocks_per_decode = -(-decode_len // BLOCK_SIZE)
    blocks_per_prefill = -(-args.prefill_len // BLOCK_SIZE)
    decode_blocks = args.decode_batch * blocks_per_decode
    runner.initialize_kv_cache(decode_blocks + args.prefill_batch * blocks_per_prefill)

    ids = [f"d{i}" for i in range(args.decode_batch)]
    prompts = random_prompts(args.decode_batch, args.context, config.vocab_size, seed=1)
    new = [
        NewRequestData(
            r,
            p,
            GREEDY,
            list(range(i * blocks_per_decode, (i + 1) * blocks_per_decode)),
            args.context - 1,
        )
        for i, (r, p) in enumerate(zip(ids, prompts))
    ]
    runner.execute_model(SchedulerOutput(new, [], dict.fromkeys(ids, 1), len(ids)))  # requests join
    state = {"step": 1}

    def decode() -> None:
        cached = [CachedRequestData(r, [], args.context - 1 + state["step"]) for r in ids]
        runner.execute_model(SchedulerOutput([], cached, dict.fromkeys(ids, 1), len(ids)))
        state["step"] += 1

    prefill_prompts = random_prompts(
        args.prefill_batch, args.prefill_len, config.vocab_size, seed=2
    )
    counter = {"n": 0}

    def prefill() -> None:
        n = counter["n"]
        counter["n"] += 1
        reqs = [
            NewRequestData(
                f"p{n}-{i}",
                p,
                GREEDY,
                list(
                    range(
                        decode_blocks + i * blocks_per_prefill,
                        decode_blocks + (i + 1) * blocks_per_prefill,
                    )
                ),
                0,
            )
            for i, p in enumerate(prefill_prompts)
        ]
        runner.execute_model(
            SchedulerOutput(
                reqs, [], {r.req_id: args.prefill_len for r in reqs}, args.prefill_len * len(reqs)
            )
        )
        runner.execute_model(
            SchedulerOutput([], [], {}, 0, finished_req_ids={r.req_id for r in reqs})
        )

    return decode, prefill


def transformers_steps(path: Path, dtype: str, args):
    """(decode, prefill) callables: transformers' own forward (sdpa attention, dense KV cache)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    cache = DynamicCache(config=cfg)
    kv_shape = (args.decode_batch, cfg.num_key_value_heads, args.context - 1, head_dim)
    for layer in range(cfg.num_hidden_layers):
        cache.update(
            torch.randn(kv_shape, dtype=model.dtype),
            torch.randn(kv_shape, dtype=model.dtype),
            layer,
        )
    tokens = torch.randint(3, cfg.vocab_size, (args.decode_batch, 1))
    positions = torch.full((args.decode_batch, 1), args.context - 1)

    @torch.inference_mode()
    def decode() -> None:
        logits = model(
            tokens, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=1
        ).logits
        logits[:, -1].float().argmax(-1)
        cache.crop(-1)  # back to the same context for the next run

    prompts = torch.tensor(
        random_prompts(args.prefill_batch, args.prefill_len, cfg.vocab_size, seed=2)
    )

    @torch.inference_mode()
    def prefill() -> None:
        logits = model(prompts, use_cache=True, logits_to_keep=1).logits
        logits[:, -1].float().argmax(-1)

    return decode, prefill


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs of each step first")
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prefill-batch", type=int, default=8)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="a ~0.2M-parameter model: a quick smoke run"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = TINY_LLAMA if args.tiny else SMALL_LLAMA
    print(f"$ python benchmarks/forward.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_model(Path(tmp) / "model", spec)
        for dtype in args.dtypes:
            ours, theirs = octavo_steps(path, dtype, args), transformers_steps(path, dtype, args)
            for index, step in (
                (0, f"decode {args.decode_batch} x ctx {args.context}"),
                (1, f"prefill {args.prefill_batch} x {args.prefill_len}"),
            ):
                ours_ms, theirs_ms = interleaved(ours[index], theirs[index], args.reps, args.warmup)
                print(
                    f"{dtype} {step}: octavo {ours_ms:.1f} ms, transformers {theirs_ms:.1f} ms",
                    flush=True,
                )
                rows.append((dtype, step, ours_ms, theirs_ms))
            del ours, theirs
            gc.collect()
    print("\n| dtype | step | octavo ms | transformers ms | octavo speed-up |")
    print("|---|---|---|---|---|")
    for dtype, step, ours_ms, theirs_ms in rows:
        print(
            f"| {dtype} | {step} | {ours_ms:.1f} | {theirs_ms:.1f} | {theirs_ms / ours_ms:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
