"""The multiprocess executor: the engine's model runner when ``tensor_parallel_size`` > 1.

It starts this node's ranks as spawned worker processes (:mod:`octavo.distributed.worker`),
waits until every one is up (or reports the one that failed, with its error), then sends each
call to every rank (across nodes: to rank 0, which broadcasts it) and waits for rank 0's
answer or for a worker's death, whichever comes first: a dead worker makes the executor dead
(``failure`` says why) and every later call fails at once.
``shutdown`` stops every worker; so do garbage collection and interpreter exit.

It answers what the engine core asks of a :class:`ModelRunner`: ``plan_kv_cache``,
``initialize_kv_cache``, ``enable_structured_output``, ``execute_model``,
``recompute_last_cached_block``.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import weakref
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler
from typing import Any, Optional

from octavo.distributed.parallel import ParallelConfig, check_shardable
from octavo.distributed.worker import WorkerSpec, run_worker
from octavo.errors import ConfigError
from octavo.kv_cache.sizing import KVCacheSizing
from octavo.model_executor.batch_runner import RunnerConfig
from octavo.model_executor.model_config import ModelConfig
from octavo.model_executor.runner_output import ModelRunnerOutput
from octavo.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker is gone: the engine cannot step any more."""


def start_workers(
    device: Optional[str],
    seed: int,
    model_config: ModelConfig,
    runner_config: RunnerConfig,
    parallel: ParallelConfig,
) -> tuple[list, list]:
    """Spawn this node's ranks; returns ``(processes, pipes)`` in rank order."""
    check_shardable(model_config, parallel.tensor_parallel_size)
    context = multiprocessing.get_context("spawn")
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // parallel.ranks_per_node)
    processes, pipes = [], []
    for local_rank, rank in enumerate(parallel.local_ranks):
        spec = WorkerSpec(
            device, seed, model_config, runner_config, parallel, rank, local_rank, threads
        )
        mine, theirs = context.Pipe()
        process = context.Process(
            target=run_worker, args=(spec, theirs), name=f"octavo-tp-rank{rank}", daemon=True
        )
        process.start()
        theirs.close()
        processes.append(process)
        pipes.append(mine)
    return processes, pipes


def await_ready(processes: list, pipes: list, ranks: range) -> list[dict[str, Any]]:
    """Each worker's start-up info, once every one is ready; a worker that failed or died first
    stops them all and is reported (a ConfigError stays one)."""
    infos: dict[int, dict] = {}
    pending = dict(enumerate(pipes))
    while pending:
        ready = wait(list(pending.values()) + [p.sentinel for p in processes])
        for i, pipe in list(pending.items()):
            if pipe in ready:
                try:
                    status, detail, is_config_error = pipe.recv()
                except EOFError:
                    status, detail, is_config_error = "error", "it exited", False
                if status != "ready":
                    stop_workers(processes, pipes)
                    error = ConfigError if is_config_error else RuntimeError
                    raise error(f"tensor-parallel rank {ranks[i]} failed to start: {detail}")
                infos[i] = detail
                del pending[i]
        dead = [i for i, p in enumerate(processes) if p.exitcode is not None and i in pending]
        if dead:
            stop_workers(processes, pipes)
            i = dead[0]
            raise RuntimeError(
                f"tensor-parallel rank {ranks[i]} exited while starting "
                f"(exit code {processes[i].exitcode})"
            )
    return [infos[i] for i in range(len(pipes))]


def stop_workers(processes: list, pipes: list) -> None:
    """Ask them to stop (across nodes rank 0 tells the others), then terminate (and kill)
    whatever is still running."""
    for pipe in pipes:
        try:
            pipe.send(("shutdown", (), False))
        except (OSError, ValueError):
            pass
    for process in processes:
        process.join(timeout=STOP_TIMEOUT_S / max(1, len(processes)))
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(timeout=2.0)
        if process.is_alive():
            process.kill()
            process.join()
    for pipe in pipes:
        pipe.close()


class MultiprocExecutor:
    """This node's tensor-parallel ranks as worker processes (see the module docstring)."""

    def __init__(
        self,
        model_config: ModelConfig,
        runner_config: RunnerConfig,
        parallel: ParallelConfig,
        *,
        device: Optional[str] = None,
        seed: int = 0,
    ):
        assert parallel.node_rank == 0, "node 0 runs the engine; the others run workers only"
        self.parallel = parallel.with_rendezvous_port()
        self.processes, self.pipes = start_workers(
            device, seed, model_config, runner_config, self.parallel
        )
        self._finalizer = weakref.finalize(self, stop_workers, self.processes, self.pipes)
        infos = await_ready(self.processes, self.pipes, self.parallel.local_ranks)
        self.recompute_last_cached_block = infos[0]["recompute_last_cached_block"]
        # the ranks that read each call: all of them on one node, else rank 0 broadcasts it
        self.call_pipes = self.pipes if self.parallel.nnodes == 1 else self.pipes[:1]
        self.failure: Optional[str] = None
        logger.info(
            "tensor parallelism: %d ranks on %d node(s), rendezvous %s",
            self.parallel.tensor_parallel_size,
            self.parallel.nnodes,
            self.parallel.init_method,
        )

    # --- what the engine core calls ------------------------------------------------------------

    def plan_kv_cache(self, cache_config) -> KVCacheSizing:
        """Every rank sizes its own cache; all take the smallest block counts."""
        plans: list[KVCacheSizing] = self._call("plan_kv_cache", cache_config, gather=True)
        return min(plans, key=lambda plan: (plan.num_gpu_blocks, plan.num_host_blocks))

    def initialize_kv_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        self._call("initialize_kv_cache", num_blocks, num_host_blocks)

    def enable_structured_output(self, backend) -> None:
        self._call("enable_structured_output", backend)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._call("execute_model", scheduler_output)

    def check_alive(self) -> Optional[str]:
        """Why the executor cannot run (a worker exited), or None."""
        if self.failure is None:
            for rank, process in zip(self.parallel.local_ranks, self.processes):
                if process.exitcode is not None:
                    self.failure = (
                        f"tensor-parallel rank {rank} exited (exit code {process.exitcode})"
                    )
                    break
        return self.failure

    def shutdown(self) -> None:
        """Stop every worker (idempotent)."""
        if self.failure is None:
            self.failure = "the engine was shut down"
        self._finalizer()

    # --- the calls ---------------------------------------------------------------------------

    def _call(self, method: str, *args: Any, gather: bool = False) -> Any:
        """Rank 0's answer to ``method(*args)`` (a list of every rank's when ``gather``)."""
        if self.check_alive() is not None:
            raise WorkerDiedError(self.failure)
        pipe = self.pipes[0]
        try:
            call = ForkingPickler.dumps((method, args, gather))  # pickled once for every rank
            for call_pipe in self.call_pipes:
                call_pipe.send_bytes(call)
            while True:
                ready = wait([pipe] + [p.sentinel for p in self.processes])
                if pipe in ready:
                    answer = pipe.recv()
                    break
                if self.check_alive() is not None:
                    raise WorkerDiedError(self.failure)
        except (EOFError, OSError):
            self.check_alive()
            self.failure = self.failure or "rank 0's pipe closed"
            raise WorkerDiedError(self.failure) from None
        status, result = answer
        if status == "ok":
            return result
        if status == "fatal":  # often because a peer died: name that one when it did
            wait([p.sentinel for p in self.processes[1:]], timeout=1.0)
            if self.check_alive() is None:
                self.failure = f"tensor-parallel rank 0 failed: {result}"
            raise WorkerDiedError(self.failure)
        raise result  # a RequestError: those requests fail, the engine goes on
