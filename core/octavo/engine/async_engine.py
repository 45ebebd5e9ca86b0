"""AsyncEngine: the synchronous LLMEngine driven by a thread of its own, for asyncio servers.

Requests go in through a thread-safe command queue; the engine thread blocks on it while idle
(no spinning), and otherwise drains it between steps. Each request has an ``asyncio.Queue`` of
outputs; one step's outputs reach the event loop in a single ``call_soon_threadsafe`` callback.
A consumer that stops listening (a client gone) aborts its request, which frees its KV blocks.
A request the engine fails on its own (``RequestOutput.error``: a step or its output failed for
it alone) ends with a ``RequestError`` while the others go on. If a step raises anything else,
the thread records the error, fails every request in flight and exits; ``is_alive`` turns False
(``/health`` answers 503).

Why a thread rather than a process: a thread hands outputs to the event loop without
serialising them, and the model's forward runs in torch kernels that release the GIL. The cost is
that the event loop's Python work (SSE framing, JSON, HTTP) and the engine's own Python work take
turns on the GIL. benchmarks/serve_overhead.py measures what that costs against the offline
engine; a process split (as vLLM V1 does) is the next step if it shows the server HTTP-bound.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import queue
import threading
from typing import AsyncIterator, Optional, Union

from octavo.engine.llm_engine import LLMEngine
from octavo.errors import RequestError
from octavo.inputs import ProcessedRequest
from octavo.metrics import EngineMetrics
from octavo.outputs import RequestOutput

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (it failed, or it was shut down); no request can run."""


@dataclasses.dataclass(slots=True)
class _Stream:
    """The engine thread's record of one request: where its outputs go."""

    outputs: asyncio.Queue
    record_metrics: bool
    num_generation_tokens: int = 0


@dataclasses.dataclass(slots=True)
class _AddCommand:
    request: ProcessedRequest
    stream: _Stream


@dataclasses.dataclass(slots=True)
class _AbortCommand:
    request_ids: list[str]


_STOP = object()


class AsyncEngine:
    """An LLMEngine whose ``step()`` loop runs in its own thread; ``generate`` is async."""

    def __init__(self, engine: LLMEngine, metrics: Optional[EngineMetrics] = None) -> None:
        self.engine = engine
        self.metrics = metrics if metrics is not None else EngineMetrics()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._submit_lock = threading.Lock()  # orders submissions against the loop's death
        self._error: Optional[BaseException] = None
        self._stopped = False
        # requests in flight per LoRA adapter id (event loop only): an adapter in use stays
        self.lora_in_flight: collections.Counter[int] = collections.Counter()

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        """Start the engine thread; outputs are delivered to ``loop`` (default: the running one)."""
        assert self._thread is None, "the engine loop is already started"
        self._loop = loop if loop is not None else asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="octavo-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort whatever still runs, stop the engine thread and what the engine started
        (tensor-parallel workers)."""
        if self._thread is not None:
            self._commands.put(_STOP)
            self._thread.join(timeout)
        self.engine.core.shutdown()

    @property
    def is_alive(self) -> bool:
        """True while the engine thread runs and has not failed, nor a worker died."""
        return (
            self._thread is not None
            and self._thread.is_alive()
            and self._error is None
            and not self._stopped
            and self.engine.core.check_alive() is None
        )

    @property
    def dead_reason(self) -> str:
        """Why the engine loop is not running, for error messages."""
        if self._error is not None:
            return f"the engine loop failed: {type(self._error).__name__}: {self._error}"
        failure = self.engine.core.check_alive()
        if failure is not None:
            return f"the engine cannot run: {failure}"
        return "the engine loop is not running"

    # --- the event loop's side ----------------------------------------------------------------

    async def generate(
        self, request: ProcessedRequest, *, record_metrics: bool = True
    ) -> AsyncIterator[RequestOutput]:
        """Run one request (from ``engine.input_processor.process``); yield its RequestOutputs
        until the finished one.

        Leaving early (the consumer is cancelled or closes the iterator) aborts the request.
        Raises ValueError for a request the engine refuses, RequestError if the engine failed
        this request alone, EngineDeadError if the loop dies.
        """
        request_id = request.request_id
        stream = _Stream(asyncio.Queue(), record_metrics)
        command = _AddCommand(request, stream)
        with self._submit_lock:
            if not self.is_alive:
                raise EngineDeadError(self.dead_reason)
            self._commands.put(command)
        finished = False
        lora = request.options.lora_request
        if lora is not None:
            self.lora_in_flight[lora.lora_int_id] += 1
        try:
            while not finished:
                item = await stream.outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if lora is not None:
                self.lora_in_flight[lora.lora_int_id] -= 1
            if not finished:
                self.abort(request_id)

    def abort(self, request_ids: Union[str, list[str]]) -> None:
        """Abort requests (unknown or finished ids are ignored); their blocks are freed."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self._commands.put(_AbortCommand(ids))

    # --- the engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                if not self._take_commands(block=not engine.has_unfinished_requests()):
                    break
                if engine.has_unfinished_requests():
                    self._deliver(engine.step())
                self.metrics.on_step(engine.core)
        except BaseException as exc:  # noqa: BLE001 - any failure ends the loop; requests must hear of it
            logger.exception("the engine loop failed")
            self._error = exc
        finally:
            with self._submit_lock:
                self._stopped = True
            self._fail_all(
                EngineDeadError(self.dead_reason if self._error else "the engine was shut down")
            )

    def _take_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if ``block``); False once asked to stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                return False
            if isinstance(command, _AddCommand):
                self._add(command)
            else:
                self._deliver(
                    self.engine.abort_request(command.request_ids), aborted=command.request_ids
                )
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, command: _AddCommand) -> None:
        request = command.request
        try:
            self.engine.add_processed_request(request)
        except Exception as exc:  # noqa: BLE001 - a refused request must not end the loop
            self._send([(command.stream.outputs, exc)])
            return
        self._streams[request.request_id] = command.stream
        if command.stream.record_metrics:
            self.metrics.on_request_added(len(request.prompt.token_ids))

    def _deliver(self, outputs: list[RequestOutput], aborted: Optional[list[str]] = None) -> None:
        items = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if stream.record_metrics and output.metrics is not None:
                total = output.metrics.num_generation_tokens
                self.metrics.on_tokens(total - stream.num_generation_tokens)
                stream.num_generation_tokens = total
            if output.finished:
                del self._streams[output.request_id]
                if stream.record_metrics and output.error is not None:
                    self.metrics.on_request_failed()
                elif stream.record_metrics:
                    self.metrics.on_request_finished(output)
            failed = output.finished and output.error is not None
            items.append(
                (
                    stream.outputs,
                    RequestError({output.request_id: output.error}) if failed else output,
                )
            )
        for request_id in aborted or ():
            self._streams.pop(request_id, None)  # aborted before it produced anything
        self._send(items)

    def _send(self, items: list) -> None:
        if not items or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _fail_all(self, error: EngineDeadError) -> None:
        items = []
        while True:  # commands that arrived too late
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _AddCommand):
                items.append((command.stream.outputs, error))
        for stream in self._streams.values():
            items.append((stream.outputs, error))
            if stream.record_metrics and self._error is not None:
                self.metrics.on_request_failed()
        self._streams.clear()
        self._send(items)


def _put_all(items: list) -> None:
    for outputs, item in items:
        outputs.put_nowait(item)
