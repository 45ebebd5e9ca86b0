"""The cpu platform's compiled forward (``--no-enforce-eager``) against the eager one, per step.

    .venv/bin/python benchmarks/compiled_graph.py /tmp/tiny-llama [--batch 1 4 8 32]
        [--rounds 3] [--prompt-len 300] [--output-len 65] [--compile-cache-dir DIR]

One engine is started with ``--no-enforce-eager`` (its graphs compiled at start-up, as a server
does). Then, for each batch size, the same greedy generation (``--batch`` prompts of
``--prompt-len`` random token ids, ``--output-len`` tokens each) runs with the compiled forward
and with the eager model behind the same runner, alternately for ``--rounds`` rounds. Printed:
the median time of the model forward over the decode steps, best round, and the whole decode
step (generation time over output tokens, prefill included). Start-up, cold and warm, is
``octavo bench startup MODEL --serve-args "--no-enforce-eager --compile-cache-dir DIR"``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from octavo import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=300)
    parser.add_argument("--output-len", type=int, default=65)
    parser.add_argument("--compile-cache-dir", default=None)
    args = parser.parse_args()

    start = time.perf_counter()
    llm = LLM(
        args.model,
        kv_cache_memory="1GiB",
        enable_prefix_caching=False,
        enforce_eager=False,
        compile_cache_dir=args.compile_cache_dir,
    )
    print(f"engine ready in {time.perf_counter() - start:.1f} s (graphs compiled or loaded)")
    threaded = llm.engine.core.runner.forward  # the cpu platform's ThreadedForward
    variants = {"compiled": threaded.model, "eager": threaded.model.model}
    forward_s: list[float] = []
    current = {"forward": variants["compiled"]}

    def timed_forward(*inputs):
        begin = time.perf_counter()
        out = current["forward"](*inputs)
        forward_s.append(time.perf_counter() - begin)
        return out

    threaded.model = timed_forward
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    print("| batch | forward ms, eager | compiled | step ms, eager | compiled |")
    print("|---|---|---|---|---|")
    for batch in args.batch:
        prompts = [
            {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.prompt_len)]}
            for _ in range(batch)
        ]
        forward_ms = {name: [] for name in variants}
        step_ms = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, forward in variants.items():
                current["forward"] = forward
                forward_s.clear()
                begin = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                elapsed = time.perf_counter() - begin
                forward_ms[name].append(statistics.median(forward_s[1:]) * 1e3)  # decode steps
                step_ms[name].append(elapsed / args.output_len * 1e3)
        print(
            f"| {batch} | {min(forward_ms['eager']):.2f} | {min(forward_ms['compiled']):.2f} "
            f"| {min(step_ms['eager']):.2f} | {min(step_ms['compiled']):.2f} |"
        )


if __name__ == "__main__":
    main()
