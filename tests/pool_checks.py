"""The clean-pool check engine tests share: after a workload nothing is left behind."""

from __future__ import annotations

from octavo import LLM


def assert_pool_clean(llm: LLM) -> None:
    """After a workload: every block back in the pool, no request left in any queue."""
    core = llm.engine.core
    kv, scheduler = core.kv_cache_manager, core.scheduler
    assert kv.num_free_blocks == kv.block_pool.num_blocks
    assert all(block.ref_cnt == 0 for block in kv.block_pool.blocks)
    assert kv.host_pool.num_free_blocks == kv.host_pool.num_blocks
    assert (
        not scheduler.requests
        and not scheduler.running
        and not scheduler.swapped
        and not len(scheduler.waiting)
    )
    assert not llm.engine.has_unfinished_requests()
