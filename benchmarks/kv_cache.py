"""Time the KV cache manager's bookkeeping: the per-step cost prefix caching must keep small.

    .venv/bin/python benchmarks/kv_cache.py [--repeats 5] [--block-size 16]

1. allocate + free: 1,000 requests of 64 blocks each, allocated then freed, into a fresh pool
   (caching on and off) and into a pool whose every free block is cached (each allocation evicts).
2. hashing: the chained block hashes of a 32k-token prompt, sha256 and fast.
3. lookup: ``get_computed_blocks`` of a 32k-token prompt that is fully cached.
4. one step with 256 running requests: every request appends its sampled token (hashing a block
   when one fills) and gets its slot; plus, in the mixed variant, one request finishes and a new
   512-token prompt arrives (hashed, looked up, allocated). Target: under 1 ms per step.

Each figure is the median of ``--repeats`` runs of wall-clock time, with this thread's CPU time
in brackets (on a shared, busy machine the CPU time is the steadier figure); the load average at
start is printed too. Hashes of the requests of (1) are computed outside the timed region.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Callable

from octavo.kv_cache import BlockHasher, KVCacheManager
from octavo.request import Request

VOCAB = 32000


class Timer:
    """Wall-clock and thread CPU seconds of a ``with`` block."""

    def __enter__(self) -> "Timer":
        self.wall, self.cpu = time.perf_counter(), time.thread_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.thread_time() - self.cpu


def measure(fn: Callable[[], Timer], repeats: int) -> tuple[float, float]:
    """Median wall and median CPU seconds of ``fn``'s timed part over ``repeats`` runs."""
    samples = [fn() for _ in range(repeats)]
    return statistics.median(t.wall for t in samples), statistics.median(t.cpu for t in samples)


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(length)]


def bench_allocate_free(
    block_size: int, enable_caching: bool, prefill_cache: bool, rng: random.Random
) -> Timer:
    num_requests, blocks_per_request = 1000, 64
    manager = KVCacheManager(
        num_requests * blocks_per_request, block_size, enable_caching=enable_caching
    )
    num_tokens = blocks_per_request * block_size

    def make_requests(prefix: str) -> list[Request]:
        return [
            Request(
                f"{prefix}{i}", random_prompt(rng, num_tokens), block_hasher=manager.block_hasher
            )
            for i in range(num_requests)
        ]

    if prefill_cache:  # leave every block cached and free, so the timed round evicts
        warm = make_requests("w")
        for request in warm:
            manager.allocate_slots(request, num_tokens)
            request.num_computed_tokens = num_tokens
        for request in warm:
            manager.free(request)
    requests = make_requests("r")
    with Timer() as timer:
        for request in requests:
            manager.allocate_slots(request, num_tokens)
            request.num_computed_tokens = num_tokens
        for request in requests:
            manager.free(request)
    return timer


def bench_hashing(block_size: int, hash_algo: str, rng: random.Random) -> Timer:
    hasher = BlockHasher(block_size, hash_algo)
    prompt = random_prompt(rng, 32768)
    with Timer() as timer:
        Request("r", prompt, block_hasher=hasher)
    return timer


def bench_lookup(block_size: int, rng: random.Random) -> Timer:
    manager = KVCacheManager(32768 // block_size + 1, block_size)
    prompt = random_prompt(rng, 32768)
    first = Request("a", prompt, block_hasher=manager.block_hasher)
    manager.allocate_slots(first, 32768)
    first.num_computed_tokens = 32768
    again = Request("b", prompt, block_hasher=manager.block_hasher)
    with Timer() as timer:
        hits, num_hit = manager.get_computed_blocks(again)
    assert num_hit == 32768 - block_size
    return timer


def bench_step(block_size: int, mixed: bool, rng: random.Random, num_steps: int = 200) -> Timer:
    """Per-step time, averaged over ``num_steps`` steps of 256 running requests."""
    num_running, prompt_len = 256, 512
    manager = KVCacheManager(num_running * (prompt_len + num_steps) // block_size * 2, block_size)
    running = []
    for i in range(num_running):
        request = Request(
            f"r{i}", random_prompt(rng, prompt_len), block_hasher=manager.block_hasher
        )
        manager.allocate_slots(request, prompt_len)
        request.num_computed_tokens = prompt_len
        running.append(request)
    new_prompts = [random_prompt(rng, prompt_len) for _ in range(num_steps)]
    sampled = [rng.randrange(VOCAB) for _ in range(num_steps)]
    with Timer() as timer:
        for step in range(num_steps):
            token = sampled[step]
            for request in running:
                request.append_output_token_ids(token)
                if manager.allocate_slots(request, 1) is None:
                    raise RuntimeError("benchmark pool too small")
                request.num_computed_tokens += 1
            if mixed:
                manager.free(running.pop(0))
                request = Request(f"n{step}", new_prompts[step], block_hasher=manager.block_hasher)
                hits, num_hit = manager.get_computed_blocks(request)
                manager.allocate_slots(request, prompt_len - num_hit, hits, num_hit)
                request.num_computed_tokens = prompt_len
                running.append(request)
            manager.take_pending_copies()
    timer.wall /= num_steps
    timer.cpu /= num_steps
    return timer


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    rng = random.Random(0)
    bs, repeats = args.block_size, args.repeats

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"block size {bs}; median of {repeats} runs: wall (thread CPU); "
        f"load average {load} on {os.cpu_count()} CPUs"
    )
    cases = [
        ("caching on, fresh pool", True, False),
        ("caching off", False, False),
        ("caching on, every allocation evicts", True, True),
    ]
    for label, caching, evicting in cases:
        wall, cpu = measure(lambda: bench_allocate_free(bs, caching, evicting, rng), repeats)
        print(
            f"allocate+free 1000 x 64 blocks, {label:<36} "
            f"{1000 / wall:8,.0f} req/s  ({1000 / cpu:,.0f})"
        )
    for algo in ("sha256", "fast"):
        wall, cpu = measure(lambda: bench_hashing(bs, algo, rng), repeats)
        print(
            f"hash a 32k-token prompt, {algo:<6} {wall * 1e3:6.1f} ms = "
            f"{32768 / wall / 1e6:5.2f} M tokens/s  ({32768 / cpu / 1e6:.2f})"
        )
    wall, cpu = measure(lambda: bench_lookup(bs, rng), repeats)
    print(f"lookup of a fully cached 32k-token prompt  {wall * 1e6:6.0f} us  ({cpu * 1e6:.0f})")
    for label, mixed in [
        ("256 decodes", False),
        ("256 decodes + 1 finish + 1 new 512-token prompt", True),
    ]:
        wall, cpu = measure(lambda: bench_step(bs, mixed, rng), repeats)
        print(f"one step, {label:<48} {wall * 1e3:6.3f} ms  ({cpu * 1e3:.3f})")


if __name__ == "__main__":
    main()
