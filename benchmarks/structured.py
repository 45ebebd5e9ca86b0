"""The cost of structured output on the bundled demo model, side by side in one run: seconds per
output token of JSON-schema-constrained requests against free ones, at batch 1 and 32.

    python benchmarks/structured.py                 # 5 alternated rounds
    python benchmarks/structured.py --rounds 3 --out /tmp/structured.json

Workload, greedy: code prompts, 64 new tokens each. Free requests ignore EOS; constrained ones
follow a schema of sixteen strings of 6-12 characters, longer than 64 tokens, so that both kinds
run the same 64 steps in lockstep and the comparison is per step, not per output length.
Constrained and free runs alternate round by round (the host is noisy); each figure is the
median of its rounds; the overhead is the constrained run's time per token over the free run's,
minus one. Grammars are compiled (and cached) before the first round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from octavo import LLM, SamplingParams

DEMO = Path(__file__).resolve().parent.parent / "core" / "octavo" / "data" / "demo-model"
SCHEMA = {
    "type": "array",
    "items": {"type": "string", "minLength": 6, "maxLength": 12},
    "minItems": 16,
    "maxItems": 16,
}
PROMPTS = ["def main():", "import os\n", "class Point:", "# settings\nconfig = "]


def per_token_seconds(llm: LLM, batch: int, constrained: bool, requests: int) -> float:
    """Seconds per output token over ``requests`` requests, ``batch`` at a time."""
    params = (
        SamplingParams(temperature=0.0, max_tokens=64, structured_outputs={"json": SCHEMA})
        if constrained
        else SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    )
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(requests)]
    tokens, start = 0, time.perf_counter()
    for first in range(0, requests, batch):
        outputs = llm.generate(prompts[first : first + batch], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 64 for o in outputs)  # in lockstep
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
    return (time.perf_counter() - start) / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    llm = LLM(str(DEMO), kv_cache_memory="256MiB")
    runs = {(batch, constrained): [] for batch in (1, 32) for constrained in (False, True)}
    for key in runs:  # warm-up: compiles and caches the grammar, warms the kernels
        per_token_seconds(llm, key[0], key[1], key[0] * 2)
    for _ in range(args.rounds):
        for batch, constrained in runs:
            requests = 8 if batch == 1 else 64
            runs[batch, constrained].append(per_token_seconds(llm, batch, constrained, requests))
    report = {}
    for batch in (1, 32):
        free = statistics.median(runs[batch, False])
        constrained = statistics.median(runs[batch, True])
        report[f"batch-{batch}"] = {
            "free_ms_per_token": free * 1e3,
            "constrained_ms_per_token": constrained * 1e3,
            "overhead": constrained / free - 1,
            "rounds_free_ms": [x * 1e3 for x in runs[batch, False]],
            "rounds_constrained_ms": [x * 1e3 for x in runs[batch, True]],
        }
        print(
            f"batch {batch:2d}: free {free * 1e3:6.3f} ms/token, constrained "
            f"{constrained * 1e3:6.3f} ms/token, overhead {constrained / free - 1:+.1%}"
        )
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
