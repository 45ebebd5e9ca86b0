"""A node other than 0 of a multi-node run: it runs its ranks' workers and no engine.

Node 0 runs the engine and rank 0, which drives every rank through torch.distributed; this node
starts its ranks, waits for them to join, and then until they exit: when node 0 shuts down (they
are told to stop), or when it dies (their collectives fail). SIGTERM stops them.
"""

from __future__ import annotations

import logging
import signal
from multiprocessing.connection import wait

from octavo.config import EngineArgs
from octavo.distributed.executor import await_ready, start_workers, stop_workers
from octavo.platform.facade import Platform

logger = logging.getLogger(__name__)


def run_headless(args: EngineArgs) -> int:
    """Run this node's workers until they exit; 0 when every one exited cleanly."""
    from octavo.engine.engine_core import resolve_engine

    parallel = args.parallel_config
    platform = Platform.select(args.device)
    args, model_config, runner_config = resolve_engine(args, platform)
    processes, pipes = start_workers(
        platform.name, args.seed, model_config, runner_config, parallel
    )
    stopping = []

    def stop(signum, frame) -> None:
        stopping.append(signum)
        stop_workers(processes, [])

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        await_ready(processes, pipes, parallel.local_ranks)
        logger.info(
            "node %d of %d: ranks %s joined node 0's engine at %s",
            parallel.node_rank,
            parallel.nnodes,
            list(parallel.local_ranks),
            parallel.init_method,
        )
        _wait_until_exited(processes)
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_workers(processes, pipes)
    codes = [p.exitcode for p in processes]
    if any(codes) and not stopping:
        logger.error("node %d: worker exit codes %s", parallel.node_rank, codes)
        return 1
    return 0


def _wait_until_exited(processes: list) -> None:
    """Return once every process has exited. It waits on the sentinels alone: a process closes
    its sentinel a moment before ``is_alive()`` can tell it exited, so asking ``is_alive()``
    between waits can leave nothing to wait on, and ``wait([])`` never returns."""
    pending = [p.sentinel for p in processes]
    while pending:
        ready = wait(pending)
        pending = [sentinel for sentinel in pending if sentinel not in ready]
    for process in processes:
        process.join()
