"""Where one offline ``LLM.generate`` spends its time: torch profiler's table, by self CPU time.

    .venv/bin/python benchmarks/profile_generate.py MODEL [--num-prompts 128] [--output-len 128]
        [--rows 22]

Token-id prompts of 64-512 tokens (seed 1), greedy, EOS ignored, prefix caching off (so every
prompt is prefilled); a short warm-up run comes first.
"""

from __future__ import annotations

import argparse
import random
import time

# ruff: noqa: I001 - octavo comes before torch: it sets OMP_WAIT_POLICY before OpenMP loads
from octavo import LLM, SamplingParams
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rows", type=int, default=22)
    args = parser.parse_args()
    llm = LLM(args.model, kv_cache_memory=2 << 30, enable_prefix_caching=False)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(1)
    prompts = [
        [rng.randrange(10, vocab) for _ in range(rng.randrange(64, 512))]
        for _ in range(args.num_prompts)
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:8], SamplingParams(max_tokens=4), use_tqdm=False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, greedy, use_tqdm=False)
        elapsed = time.perf_counter() - start
    num_tokens = args.num_prompts * args.output_len
    print(f"{elapsed:.2f} s, {num_tokens / elapsed:.0f} output tok/s (under the profiler)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
