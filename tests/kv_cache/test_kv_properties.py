"""Random schedules of allocate/append/fork/free/evict/swap against the KV cache invariants.

Each step is one scheduling pass in the engine's order (running requests first, preempting by
recompute or swap when memory runs out; then swap-ins; then waiting requests with prefix
lookups), followed by the worker's part (planned copies, then the forward's KV writes). After
every step the pool's books must balance, the prefix cache must only point at blocks holding
the tokens their hash stands for, and every request must read back its own tokens.
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kv_sim import SimWorker

from octavo.kv_cache import KVCacheManager
from octavo.request import Request

# Three prompt families with shared prefixes, so lookups hit and eviction matters.
FAMILIES = [
    [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 0, 3],
    [7, 3, 9, 1, 5, 5, 5, 5, 1, 2],
    [2, 2, 2, 2, 2, 2, 2, 2],
]


class KVCacheMachine(RuleBasedStateMachine):
    num_blocks, block_size, num_host_blocks, enable_caching = 8, 2, 6, True

    def __init__(self):
        super().__init__()
        self.manager = KVCacheManager(
            self.num_blocks,
            self.block_size,
            enable_caching=self.enable_caching,
            num_host_blocks=self.num_host_blocks,
        )
        self.worker = SimWorker(self.manager, num_layers=1)
        self.waiting: dict[str, Request] = {}
        self.running: dict[str, Request] = {}
        self.swapped: dict[str, Request] = {}
        self.next_id = 0
        self.block_tokens: dict[bytes, tuple[int, list[int]]] = {}  # hash -> (block index, tokens)

    # --- helpers ---------------------------------------------------------------------------

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _remember_hashes(self, request: Request) -> None:
        bs = self.block_size
        for i, block_hash in enumerate(request.block_hashes):
            entry = (i, request.all_token_ids[i * bs : (i + 1) * bs])
            assert self.block_tokens.setdefault(block_hash, entry) == entry, "hash collision"

    def _preempt(self, request: Request, swap: bool, scheduled: dict | None = None) -> None:
        del self.running[request.request_id]
        if scheduled is not None:
            scheduled.pop(
                request.request_id, None
            )  # scheduled earlier in this pass: it does not run
        if swap and self.manager.swap_out(request) is not None:
            self.swapped[request.request_id] = request
            return
        self.manager.free(request)
        request.num_computed_tokens = 0
        self.waiting[request.request_id] = request

    def _schedule_running(self, data, scheduled: dict) -> None:
        for request in list(self.running.values()):
            if request.request_id not in self.running:
                continue  # preempted earlier in this pass
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = data.draw(st.integers(1, remaining))
            lookahead = data.draw(st.integers(0, 2))
            while (
                self.manager.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)
                is None
            ):
                # any running request may be the victim (as under priority scheduling), even one
                # already scheduled in this pass: its chunk then never runs
                victim = data.draw(st.sampled_from(list(self.running.values())))
                self._preempt(victim, data.draw(st.booleans()), scheduled)
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = (request, num_new)

    def _schedule_new(self, data, scheduled: dict) -> None:
        for request in list(self.swapped.values()):
            if data.draw(st.booleans()) and self.manager.swap_in(request) is not None:
                del self.swapped[request.request_id]
                self.running[request.request_id] = request
        for request in list(self.waiting.values()):
            if not data.draw(st.booleans()):
                continue
            hits, num_hit = self.manager.get_computed_blocks(request)
            num_new = data.draw(st.integers(1, request.num_tokens - num_hit))
            if self.manager.allocate_slots(request, num_new, hits, num_hit) is not None:
                request.num_computed_tokens = num_hit
                del self.waiting[request.request_id]
                self.running[request.request_id] = request
                scheduled[request.request_id] = (request, num_new)

    def _execute(self, data, scheduled: dict) -> None:
        self.worker.apply_pending()
        for request, num_new in scheduled.values():
            start = request.num_computed_tokens
            self.worker.write(request, start, start + num_new)
            request.num_computed_tokens += num_new
            if request.num_computed_tokens == request.num_tokens:
                self._sample(data, request)

    def _sample(self, data, request: Request) -> None:
        """Append a sampled token; sometimes branch first (beam search), the child taking another
        token."""
        token = data.draw(st.integers(0, 3))
        if data.draw(st.booleans()):
            child = request.fork(self._new_id())
            self.manager.fork(request, child)
            self.running[child.request_id] = child
            child.append_output_token_ids((token + 1) % 4)
            self._remember_hashes(child)
        request.append_output_token_ids(token)
        self._remember_hashes(request)

    def _all_requests(self):
        return [*self.waiting.values(), *self.running.values(), *self.swapped.values()]

    # --- rules -----------------------------------------------------------------------------

    @rule(
        family=st.integers(0, len(FAMILIES) - 1),
        length=st.integers(1, 12),
        suffix=st.lists(st.integers(0, 3), max_size=4),
        salt=st.sampled_from([None, "tenant"]),
        lora_id=st.sampled_from([None, 1]),
    )
    def add_request(self, family, length, suffix, salt, lora_id):
        prompt = FAMILIES[family][:length] + suffix
        request = Request(
            self._new_id(),
            prompt,
            cache_salt=salt,
            lora_id=lora_id,
            block_hasher=self.manager.block_hasher,
        )
        self._remember_hashes(request)
        self.waiting[request.request_id] = request

    @rule(data=st.data())
    def step(self, data):
        scheduled: dict = {}
        self._schedule_running(data, scheduled)
        self._schedule_new(data, scheduled)
        self._execute(data, scheduled)

    @rule(data=st.data())
    def another_step(self, data):
        self.step(data)  # a second rule, so that steps come up more often than other rules

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork_between_steps(self, data):
        parent = data.draw(
            st.sampled_from(sorted(self.running.values(), key=lambda r: r.request_id))
        )
        child = parent.fork(self._new_id())
        self.manager.fork(parent, child)
        self.running[child.request_id] = child

    @precondition(lambda self: self.running)
    @rule(data=st.data(), swap=st.booleans())
    def preempt(self, data, swap):
        request = data.draw(
            st.sampled_from(sorted(self.running.values(), key=lambda r: r.request_id))
        )
        self._preempt(request, swap)
        self.worker.apply_pending()

    @precondition(lambda self: self.waiting or self.running or self.swapped)
    @rule(data=st.data())
    def finish(self, data):
        request = data.draw(
            st.sampled_from(sorted(self._all_requests(), key=lambda r: r.request_id))
        )
        self.manager.free(request)
        for queue in (self.waiting, self.running, self.swapped):
            queue.pop(request.request_id, None)

    @rule()
    def reset_prefix_cache(self):
        self.manager.reset_prefix_cache()

    # --- invariants ------------------------------------------------------------------------

    @invariant()
    def free_and_referenced_blocks_partition_the_pool(self):
        pool = self.manager.block_pool
        free = list(pool.free_queue)
        assert len(free) == pool.num_free_blocks == len({b.block_id for b in free})
        assert all(block.ref_cnt == 0 for block in free), "a free block is referenced"
        referenced = [block for block in pool.blocks if block.ref_cnt > 0]
        assert len(free) + len(referenced) == pool.num_blocks
        assert all(block.ref_cnt >= 0 for block in pool.blocks)

    @invariant()
    def refcounts_equal_table_holdings(self):
        holdings = Counter(
            block_id
            for request in self._all_requests()
            for block_id in self.manager.get_block_ids(request.request_id)
        )
        for block in self.manager.block_pool.blocks:
            assert block.ref_cnt == holdings[block.block_id], block

    @invariant()
    def prefix_cache_points_only_at_matching_blocks(self):
        bs = self.block_size
        for block_hash, block in self.manager.block_pool.cached_blocks.items():
            assert block.block_hash == block_hash
            index, tokens = self.block_tokens[block_hash]
            assert self.worker.block_contents(block.block_id) == (
                tokens,
                list(range(index * bs, (index + 1) * bs)),
            )

    @invariant()
    def every_request_reads_back_its_tokens(self):
        for request in self.running.values():
            self.worker.assert_holds(request)
        for request in self.swapped.values():
            self.worker.assert_host_holds(request)
        host_ids = [
            h for r in self.swapped.values() for h in self.manager.get_host_block_ids(r.request_id)
        ]
        assert len(host_ids) == len(set(host_ids))
        assert (
            len(host_ids) + self.manager.host_pool.num_free_blocks
            == self.manager.host_pool.num_blocks
        )

    @invariant()
    def waste_below_one_block_without_lookahead(self):
        stats = self.manager.stats()
        assert stats.num_used_slots <= stats.num_allocated_slots
        assert (
            0 <= stats.max_request_waste <= self.block_size - 1 + 2
        )  # a partial block + 2 lookahead slots

    def teardown(self):
        for request in self._all_requests():
            self.manager.free(request)
        pool = self.manager.block_pool
        assert pool.num_free_blocks == pool.num_blocks and all(
            block.ref_cnt == 0 for block in pool.blocks
        )
        assert self.manager.host_pool.num_free_blocks == self.manager.host_pool.num_blocks
        assert self.manager.stats().num_running_requests == 0


class KVCacheMachineBigBlocks(KVCacheMachine):
    num_blocks, block_size, num_host_blocks = 6, 4, 3


class KVCacheMachineNoCaching(KVCacheMachine):
    num_blocks, block_size, num_host_blocks, enable_caching = 8, 2, 0, False


_settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
TestKVCache = KVCacheMachine.TestCase
TestKVCache.settings = _settings
TestKVCacheBigBlocks = KVCacheMachineBigBlocks.TestCase
TestKVCacheBigBlocks.settings = _settings
TestKVCacheNoCaching = KVCacheMachineNoCaching.TestCase
TestKVCacheNoCaching.settings = settings(_settings, max_examples=40)
