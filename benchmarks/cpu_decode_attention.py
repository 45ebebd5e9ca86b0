"""Decode attention of the tiny benchmark model's shapes (8 query heads, 4 KV heads, head_dim 32,
block size 16) at batch 128, as the prefix-shared workload of ``benchmarks/compare`` decodes:

    .venv/bin/python benchmarks/cpu_decode_attention.py [--threads 1] [--repeats 8] [--rounds 5]

Each request has 64-256 own prompt tokens and 64 decoded ones, plus (two of the three cases) a
256-token prefix: shared by every request through the same blocks (prefix caching: the kernel's
cascade attends it once for all), or copied into each request's own blocks (no caching). Four
layers' caches are attended in turn, so a pass reads what a step reads; the best of ``--repeats``
passes is printed per round, in ms a layer, the cases alternated within each round (the host is
noisy: compare the quietest rounds).
"""

from __future__ import annotations

import argparse
import time

# ruff: noqa: I001 - octavo comes before torch: it sets OMP_WAIT_POLICY before OpenMP loads
import octavo  # noqa: F401
import torch

from octavo.platform.types import AttentionMetadata, AttentionSpec
from octavo_cpu.attention import CpuAttentionBackend

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 4, 32, 16
NUM_REQUESTS, PREFIX_LEN, DECODED = 128, 256, 64
NUM_BLOCKS, NUM_LAYERS = 40_000, 4


def decode_step(own: list[int], prefix: str) -> AttentionMetadata:
    """One decode token per request; ``prefix``: "shared", "copied" or "none". Prompt blocks are
    handed out request by request, decoded blocks interleaved across requests (as an allocator
    serving them in turn would)."""
    prefix_len = 0 if prefix == "none" else PREFIX_LEN
    shared = PREFIX_LEN // BLOCK_SIZE if prefix == "shared" else 0
    seq_lens = [prefix_len + n + DECODED for n in own]
    next_block, tables = shared, []
    for n in own:
        count = -(-(prefix_len + n) // BLOCK_SIZE) - shared
        tables.append(list(range(shared)) + list(range(next_block, next_block + count)))
        next_block += count
    for r, seq_len in enumerate(seq_lens):
        more = -(-seq_len // BLOCK_SIZE) - len(tables[r])
        tables[r] += [next_block + i * NUM_REQUESTS + r for i in range(more)]
    block_table = torch.zeros(NUM_REQUESTS, max(map(len, tables)), dtype=torch.int32)
    for r, table in enumerate(tables):
        block_table[r, : len(table)] = torch.tensor(table)
    last = torch.tensor(seq_lens) - 1
    rows = torch.arange(NUM_REQUESTS)
    slot_mapping = block_table[rows, last // BLOCK_SIZE].long() * BLOCK_SIZE + last % BLOCK_SIZE
    return AttentionMetadata(
        query_start_loc=torch.arange(NUM_REQUESTS + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=slot_mapping,
        max_query_len=1,
        max_seq_len=max(seq_lens),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    own = torch.randint(64, 257, (NUM_REQUESTS,), generator=generator).tolist()
    cases = {
        "own tokens only": decode_step(own, "none"),
        "prefix shared (cascade)": decode_step(own, "shared"),
        "prefix copied (no caching)": decode_step(own, "copied"),
    }
    spec = AttentionSpec(
        NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, torch.float32, BLOCK_SIZE, HEAD_DIM**-0.5
    )
    backend = CpuAttentionBackend(spec)
    caches = [
        torch.randn(backend.kv_cache_shape(NUM_BLOCKS), generator=generator)
        for _ in range(NUM_LAYERS)
    ]
    q = torch.randn(NUM_REQUESTS, NUM_HEADS, HEAD_DIM, generator=generator)
    k, v = torch.randn(2, NUM_REQUESTS, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms a layer, best of "
        f"{args.repeats} passes over {NUM_LAYERS} layers"
    )
    print("round  " + "  ".join(f"{name:>26}" for name in cases))
    for round_ in range(args.rounds):
        best = dict.fromkeys(cases, float("inf"))
        for _ in range(args.repeats):
            for name, metadata in cases.items():
                start = time.perf_counter()
                for cache in caches:
                    backend.forward(q, k, v, cache, metadata)
                best[name] = min(best[name], (time.perf_counter() - start) / NUM_LAYERS)
        print(f"{round_:5d}  " + "  ".join(f"{best[n] * 1e3:26.3f}" for n in cases))


if __name__ == "__main__":
    main()
