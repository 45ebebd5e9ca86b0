"""Where one offline ``LLM.generate`` spends its time: torch profiler's table, by self CPU time.

    .venv/bin/python benchmarks/profile_generate.py MODEL [--num-prompts 128] [--output-len 128]
        [--rows 22] [--prefix-len N] [--dtype auto]

Token-id prompts of 64-512 tokens (seed 1), greedy, EOS ignored, prefix caching off (so every
prompt is prefilled); a short warm-up run (8 other prompts) comes first. With ``--prefix-len N``,
the prefix-shared workload of ``benchmarks/compare`` instead: a common N-token prefix plus 64-256
own tokens, prefix caching on.
"""

from __future__ import annotations

import argparse
import time

# ruff: noqa: I001 - octavo comes before torch: it sets OMP_WAIT_POLICY before OpenMP loads
from octavo import LLM, SamplingParams
from octavo.bench.datasets import prefix_requests, random_requests
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rows", type=int, default=22)
    parser.add_argument("--prefix-len", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    caching = args.prefix_len > 0
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory=2 << 30, enable_prefix_caching=caching)
    vocab = llm.engine.model_config.vocab_size
    lengths = (args.output_len, args.output_len)
    if caching:
        requests = prefix_requests(
            args.num_prompts, args.prefix_len, (64, 256), lengths, vocab, seed=1
        )
    else:
        requests = random_requests(args.num_prompts, (64, 512), lengths, vocab, seed=1)
    prompts = [list(r.prompt_token_ids) for r in requests]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm_up = random_requests(8, (64, 512), (4, 4), vocab, seed=2)  # not sharing the prefix
    llm.generate(
        [list(r.prompt_token_ids) for r in warm_up], SamplingParams(max_tokens=4), use_tqdm=False
    )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        llm.generate(prompts, greedy, use_tqdm=False)
        elapsed = time.perf_counter() - start
    num_tokens = args.num_prompts * args.output_len
    print(f"{elapsed:.2f} s, {num_tokens / elapsed:.0f} output tok/s (under the profiler)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
