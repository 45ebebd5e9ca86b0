"""A tensor-parallel worker process: one rank's model runner on its shard.

On one node the engine writes each call to every rank's pipe (measured: ~0.02 ms a call, against
~0.5 ms for a gloo broadcast, benchmarks/tensor_parallel.py); across nodes rank 0 reads the pipe
and broadcasts each call over a gloo group, so ranks on other nodes hear it too, and while the
engine is idle it broadcasts a heartbeat, so their waits never time out. Every rank runs the
call on its own runner and rank 0 answers. Every rank samples the same tokens: the logits are
all-gathered whole onto each rank, and each rank's random streams are seeded alike.

A worker exits when told to, when its parent process is gone, or when a collective fails (a
peer died); the engine sees the exit and stops.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Optional

import torch
import torch.distributed as dist

from octavo.distributed.parallel import ParallelConfig
from octavo.errors import ConfigError, RequestError
from octavo.model_executor.batch_runner import RunnerConfig
from octavo.model_executor.model_config import ModelConfig
from octavo.model_executor.model_runner import ModelRunner
from octavo.models.layers.linear import TPGroup
from octavo.platform.facade import Platform

logger = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
DIST_TIMEOUT_ENV = "OCTAVO_DIST_TIMEOUT_S"
DEFAULT_DIST_TIMEOUT_S = 600
CALLS = ("info", "plan_kv_cache", "initialize_kv_cache", "enable_structured_output")
"""What the engine may call besides ``execute_model``; ``ping`` and ``shutdown`` are the loop's."""


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What one worker process needs: the engine's resolved settings and its place."""

    device: Optional[str]
    seed: int
    model_config: ModelConfig
    runner_config: RunnerConfig
    parallel: ParallelConfig
    rank: int
    local_rank: int
    num_threads: int


def dist_timeout() -> datetime.timedelta:
    """How long a collective (the rendezvous included) may wait for a peer."""
    raw = os.environ.get(DIST_TIMEOUT_ENV, str(DEFAULT_DIST_TIMEOUT_S))
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ConfigError(
            f"{DIST_TIMEOUT_ENV}={raw!r}: give the seconds a collective may wait for a peer "
            f"(default {DEFAULT_DIST_TIMEOUT_S})"
        )
    return datetime.timedelta(seconds=seconds)


def run_worker(spec: WorkerSpec, conn) -> None:
    """The worker process's entry point: start up, say so (or why not), serve until told to
    stop. ``conn`` is this worker's pipe to the engine."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle
    _exit_with_parent()
    try:
        worker = Worker(spec)
    except BaseException as exc:  # noqa: BLE001 - the engine reports it, naming this rank
        is_config_error = isinstance(exc, ConfigError)  # the message says it all
        detail = f"ConfigError: {exc}" if is_config_error else _describe(exc)
        conn.send(("error", detail, is_config_error))
        return
    conn.send(("ready", worker.info(), False))
    worker.serve(conn)
    # Told to stop: leave at once. Tearing down the process group, or letting the interpreter
    # finalise gloo's threads, can block on or abort at a peer that is leaving too.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class Worker:
    """One rank: its process group, platform and model runner."""

    def __init__(self, spec: WorkerSpec):
        torch.set_num_threads(spec.num_threads)
        torch.manual_seed(spec.seed)  # alike on every rank: unseeded sampling agrees
        self.rank = spec.rank
        self.broadcasts = spec.parallel.nnodes > 1  # else every rank reads its own pipe
        platform = Platform.select(spec.device)
        dist.init_process_group(
            backend=platform.capabilities.dist_backend,
            init_method=spec.parallel.init_method,
            rank=spec.rank,
            world_size=spec.parallel.tensor_parallel_size,
            timeout=dist_timeout(),
        )
        world = dist.group.WORLD
        self.control = world if platform.capabilities.dist_backend == "gloo" else None
        if self.control is None:  # calls are Python objects: a gloo group carries them
            self.control = dist.new_group(backend="gloo", timeout=dist_timeout())
        tp = TPGroup(dist.get_world_size(), spec.rank, platform.communicator(world))
        self.runner = ModelRunner(
            spec.model_config,
            platform,
            spec.runner_config,
            device=platform.device_init(spec.local_rank),
            tp=tp,
        )

    def info(self) -> dict[str, Any]:
        return {"recompute_last_cached_block": self.runner.recompute_last_cached_block}

    def plan_kv_cache(self, cache_config):
        return self.runner.plan_kv_cache(cache_config)

    def initialize_kv_cache(self, num_blocks: int, num_host_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks, num_host_blocks)

    def enable_structured_output(self, backend) -> None:
        self.runner.enable_structured_output(backend)

    def serve(self, conn) -> None:
        """Run the engine's calls until ``shutdown``: read from ``conn``, or across nodes
        broadcast by rank 0, which reads them."""
        while True:
            call = self._next_call(conn) if self.rank == 0 or not self.broadcasts else None
            if self.broadcasts:
                call = self._broadcast(call)
            method, args, gather = call
            if method == "shutdown":
                return
            if method == "ping":
                continue
            try:
                answer = self._run(method, args)
            except BaseException as exc:
                if self.rank == 0:  # the engine reports why it stops
                    conn.send(("fatal", _describe(exc)))
                raise
            if gather:
                answers = [None] * dist.get_world_size() if self.rank == 0 else None
                dist.gather_object(answer, answers, dst=0, group=self.control)
                if self.rank == 0:
                    failed = [a for a in answers if a[0] != "ok"]
                    answer = failed[0] if failed else ("ok", [result for _, result in answers])
            if self.rank == 0:
                conn.send(answer)

    def _run(self, method: str, args: tuple) -> tuple:
        """``("ok", result)``, or ``("error", RequestError)`` for a failure that belongs to some
        requests (it happens alike on every rank, before any collective); anything else ends
        the worker, and with it the engine."""
        try:
            if method == "execute_model":
                return ("ok", self.runner.execute_model(*args))
            assert method in CALLS, method
            return ("ok", getattr(self, method)(*args))
        except RequestError as exc:
            return ("error", exc)

    def _next_call(self, conn) -> tuple:
        """The engine's next call, ``ping`` when there is none for a while (a heartbeat when
        it is broadcast), ``shutdown`` when the engine is gone."""
        try:
            if not conn.poll(HEARTBEAT_S):
                return ("ping", (), False)
            return conn.recv()
        except (EOFError, OSError):
            return ("shutdown", (), False)

    def _broadcast(self, call: Optional[tuple]) -> tuple:
        box = [call]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}\n{''.join(traceback.format_exception(exc))}"


def _exit_with_parent() -> None:
    """End this process when the engine's process is gone (killed, say), so that no worker is
    left behind holding memory and a port."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="octavo-parent-watch", daemon=True).start()
