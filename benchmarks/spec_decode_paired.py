"""Two builds of octavo side by side on the draft heads' batch-1 workload, pass by pass.

    .venv/bin/python benchmarks/spec_decode_paired.py --old /tmp/old-checkout \
        [--new .] [--configs none,p-eagle-every,gumiho-every] [--num-speculative-tokens 4] \
        [--rounds 12] [--batch 1]

On a shared host whose speed drifts by a third within minutes, two runs of
``benchmarks/spec_decode.py`` minutes apart differ more than a change does. Here one worker
process per checkout (its ``core`` and ``platforms/cpu`` first on ``PYTHONPATH``; ``--old`` needs
the compiled kernels built in it, or copied from this checkout when its C++ is the same) holds
an engine per configuration, and the two run one pass each of the 8 held-out prompts (batch 1,
64 greedy tokens: ``spec_decode.py``'s ``heldout-b1``) in turn, the order swapped every round.
Printed: each configuration's median tok/s per checkout, the median over rounds of new / old
(paired: both passes of a round ran within about a second of each other), and each checkout's
median ratio against the first configuration. ``--batch N`` (N > 1) runs the 16 held-out
prompts N at a time instead (``spec_decode.py``'s ``heldout-b16`` at N = 16): a change to the
decode of a few rows at once shows there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(names: list[str], k: int, batch: int) -> None:
    """Build the engines, say ready (and whether their outputs agree), then run one pass per
    configuration name read from stdin until an empty line."""
    sys.path.insert(0, str(HERE))
    import spec_decode as sd

    from octavo import LLM

    engines = {
        name: LLM(
            str(sd.DEMO), kv_cache_memory="256MiB", speculative_config=sd.configs(None, k)[name]
        )
        for name in names
    }
    prompts = sd.held_out_prompts(16, engines[names[0]].get_tokenizer())[: 8 if batch == 1 else 16]
    outputs = [sd.run_batch(llm, prompts, 64, batch)[1] for llm in engines.values()]
    print("ready", all(out == outputs[0] for out in outputs), flush=True)
    for line in sys.stdin:
        if not line.strip():
            return
        print(sd.run_batch(engines[line.strip()], prompts, 64, batch)[0], flush=True)


def start(checkout: Path, names: list[str], k: int, batch: int) -> subprocess.Popen:
    paths = [str(checkout / "core"), str(checkout / "platforms" / "cpu")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    command = [sys.executable, __file__, "--worker", ",".join(names), "--k", str(k)]
    command += ["--batch", str(batch)]
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    ready = process.stdout.readline().split()
    if not ready or ready[0] != "ready":
        raise SystemExit(f"the worker for {checkout} did not start")
    print(f"{checkout}: ready, outputs of every configuration the same: {ready[1]}")
    return process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, help="the checkout to compare against")
    parser.add_argument("--new", type=Path, default=HERE.parent)
    parser.add_argument("--configs", default="none,p-eagle-every,gumiho-every")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--batch", type=int, default=1, help="requests at once (default 1)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--k", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker.split(","), args.k, args.batch)
    if args.old is None:
        parser.error("--old CHECKOUT is required")
    names, k = args.configs.split(","), args.num_speculative_tokens
    if args.batch < 1:
        parser.error("--batch must be 1 or more")
    checkouts = {"old": args.old, "new": args.new}
    sides = {side: start(path, names, k, args.batch) for side, path in checkouts.items()}
    figures: dict = {side: {name: [] for name in names} for side in sides}
    for r in range(args.rounds):
        for name in names:
            for side in ("old", "new") if r % 2 == 0 else ("new", "old"):
                sides[side].stdin.write(name + "\n")
                sides[side].stdin.flush()
                figures[side][name].append(float(sides[side].stdout.readline()))
    for process in sides.values():
        process.stdin.write("\n")
        process.stdin.flush()
        process.wait()
    for name in names:
        old, new = figures["old"][name], figures["new"][name]
        paired = statistics.median(b / a for a, b in zip(old, new))
        print(
            f"{name:16s} old {statistics.median(old):7.1f} tok/s  new {statistics.median(new):7.1f}"
            f"  new / old, paired median x{paired:.3f}"
        )
    for side, by_name in figures.items():
        for name in names[1:]:
            ratio = statistics.median(b / a for a, b in zip(by_name[names[0]], by_name[name]))
            print(f"{side}: {name} against {names[0]}, median of rounds x{ratio:.3f}")


if __name__ == "__main__":
    main()
