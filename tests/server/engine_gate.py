"""EngineGate: hold a real engine inside its model's forward, as a hung device would, so that a
test decides how far a request gets instead of betting on how many tokens a second the machine
makes.

Nothing of the engine is replaced: a torch forward pre-hook on the runner's model blocks the
engine thread (in ``execute_model``, inside ``step()``) while ``hold(n)`` is true for the n-th
forward since the gate was opened, until ``release()``. ``hold`` is asked again every few ms
while a forward is held, so it may watch state that other threads change. A held engine still
serves HTTP (the event loop is another thread) but cannot produce a token, apply a command (an
abort, a new request) or finish a request: those wait for the step boundary after the forward.

Imported by name (``from engine_gate import ...``): every test folder has its own conftest.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

from octavo.engine.async_engine import AsyncEngine
from octavo.engine.llm_engine import LLMEngine

POLL_S = 0.005


class EngineGate:
    """``with EngineGate(engine, passes=k) as gate``: forwards after the first ``k`` are held
    until ``gate.release()`` (or the end of the block); ``hold`` replaces that rule."""

    def __init__(
        self,
        engine: LLMEngine,
        passes: int = 0,
        hold: Optional[Callable[[int], bool]] = None,
        timeout: float = 60.0,
    ) -> None:
        self.model = engine.core.runner.model
        self.hold = hold if hold is not None else (lambda n: n > passes)
        # a held forward gives up after this long: a broken test fails, it does not hang
        self.timeout = timeout
        self.num_forwards = 0
        self.num_held = 0
        self.timed_out = False
        self.holding = threading.Event()  # set while a forward is held
        self.released = threading.Event()
        self._handle: Any = None

    def _pre_forward(self, module, args) -> None:
        self.num_forwards += 1
        n = self.num_forwards
        deadline = time.monotonic() + self.timeout
        held = False
        while not self.released.is_set() and self.hold(n):
            if not held:
                held = True
                self.num_held += 1
                self.holding.set()
            if time.monotonic() > deadline:
                self.timed_out = True
                break
            self.released.wait(POLL_S)
        if held:
            self.holding.clear()

    def wait_held(self, timeout: float = 30.0) -> None:
        """Return once the engine thread is held in a forward."""
        assert self.holding.wait(timeout), (
            f"the engine was not held within {timeout} s ({self.num_forwards} forwards ran)"
        )

    def release(self) -> None:
        """Let the engine go on; no forward is held after this."""
        self.released.set()

    def __enter__(self) -> "EngineGate":
        self._handle = self.model.register_forward_pre_hook(self._pre_forward)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.release()
        self._handle.remove()
        if exc_type is None:
            assert not self.timed_out, (
                f"a forward was held for {self.timeout} s: the test never released it"
            )


def wait_for(predicate, timeout: float = 20.0) -> None:
    """Poll ``predicate`` until it holds (an AssertionError after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def pending_commands(async_engine: AsyncEngine) -> int:
    """Commands (new requests, aborts) sent to the engine thread and not yet applied.

    Reads AsyncEngine's private command queue: there is no public way to see that an abort has
    been sent but not applied yet."""
    return async_engine._commands.qsize()


def requests_in_engine(engine: LLMEngine) -> list:
    """The engine core's requests: running, waiting and swapped out (read it while the engine
    thread is held, or accept a snapshot)."""
    scheduler = engine.core.scheduler
    return [*scheduler.running, *scheduler.waiting, *scheduler.swapped]


def serving_context(server) -> Any:
    """The app's ServingContext (``num_admitted``: HTTP requests the server has not
    finished with)."""
    return server.server.config.app.state.serving
