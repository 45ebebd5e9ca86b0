"""Waste and fragmentation over a random continuous-batching workload (SPEC K3)."""

from __future__ import annotations

import random

from octavo.kv_cache import KVCacheManager
from octavo.request import Request

BLOCK_SIZE = 16


def run_workload(seed: int = 0, num_requests: int = 150, max_num_seqs: int = 32, chunk: int = 256):
    """Prompts of 64-512 tokens (some sharing a 128-token prefix), 1-128 output tokens each,
    chunked prefill and decode mixed each step; yields the manager after every step."""
    rng = random.Random(seed)
    manager = KVCacheManager(2048, BLOCK_SIZE)
    shared_prefix = [rng.randrange(32000) for _ in range(128)]
    pending = []
    for i in range(num_requests):
        prompt = [rng.randrange(32000) for _ in range(rng.randint(64, 512))]
        if rng.random() < 0.3:
            prompt[:128] = shared_prefix
        request = Request(f"r{i}", prompt, block_hasher=manager.block_hasher)
        pending.append((request, rng.randint(1, 128)))
    running: list[tuple[Request, int]] = []
    while pending or running:
        while pending and len(running) < max_num_seqs:
            request, max_tokens = pending.pop(0)
            hits, num_hit = manager.get_computed_blocks(request)
            num_new = min(chunk, request.num_tokens - num_hit)
            assert manager.allocate_slots(request, num_new, hits, num_hit) is not None
            request.num_computed_tokens = num_hit + num_new
            running.append((request, max_tokens))
        yield manager, [request for request, _ in running]
        still_running = []
        for request, max_tokens in running:
            if request.num_computed_tokens == request.num_tokens:
                request.append_output_token_ids(rng.randrange(32000))
            if request.num_output_tokens >= max_tokens:
                manager.free(request)
                continue
            num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
            assert manager.allocate_slots(request, num_new) is not None
            request.num_computed_tokens += num_new
            still_running.append((request, max_tokens))
        running = still_running


def test_waste_below_one_block_and_fragmentation_below_4_percent():
    allocated = used = steps = 0
    for manager, running in run_workload():
        for request in running:
            assert 0 <= manager.request_waste(request.request_id) < BLOCK_SIZE
        stats = manager.stats()
        assert stats.max_request_waste < BLOCK_SIZE
        allocated += stats.num_allocated_slots
        used += stats.num_used_slots
        steps += 1
    fragmentation = (allocated - used) / allocated
    print(f"\nfragmentation over {steps} steps: {fragmentation:.2%} of allocated slots")
    assert fragmentation < 0.04
    assert manager.num_free_blocks == 2048
