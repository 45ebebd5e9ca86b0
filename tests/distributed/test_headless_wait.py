"""A headless node waits for its workers by their sentinels alone (the race that once left
node 1 waiting for ever after node 0 shut down)."""

import os
import threading

from octavo.distributed.headless import _wait_until_exited


class ExitingProcess:
    """What a worker looks like in the moment after it closed its sentinel (its fds are gone)
    but before the kernel reports it exited: ``is_alive()`` says True once, then False."""

    def __init__(self):
        self.sentinel, write_end = os.pipe()
        os.close(write_end)  # readable: the process closed it on its way out
        self.alive_answers = [True]
        self.joined = False

    def is_alive(self) -> bool:
        return self.alive_answers.pop(0) if self.alive_answers else False

    def join(self, timeout=None) -> None:
        self.joined = True


def test_returns_when_a_worker_exits_while_it_is_asked_about():
    processes = [ExitingProcess(), ExitingProcess()]
    waiter = threading.Thread(target=_wait_until_exited, args=(processes,), daemon=True)
    waiter.start()
    waiter.join(timeout=10.0)  # a hang, not a slow machine: it returns at once or never
    assert not waiter.is_alive(), "wait_until_exited never returned"
    assert all(p.joined for p in processes)
    for p in processes:
        os.close(p.sentinel)
