"""The compiled kernels' work sharing (csrc/work_sharing.h): which thread computes an item never
changes a result, two callers at once each get their own answers, a forked child (whose
parent's helper threads do not exist) runs the kernels instead of waiting for them, and helpers
that yield their core between jobs (beside oneDNN's GEMMs) compute the same."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch

from octavo_cpu.kernels import load_kernels

OPS = load_kernels().ops
pytestmark = pytest.mark.skipif(OPS is None, reason="no compiled cpu kernels on this host")


def _problem(seed: int, rows: int = 96) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 256, generator=generator)
    weight = torch.randn(768, 256, generator=generator)
    return x, OPS.pack_linear_weight(weight)


def _linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], 768)
    OPS.linear(out, x, packed)
    return out


def _on_one_thread(fn):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_two_threads_give_the_one_thread_bits(two_threads):
    x, packed = _problem(0)
    expected = _on_one_thread(lambda: _linear(x, packed))
    for _ in range(20):  # the helper joins some calls late or not at all
        assert torch.equal(_linear(x, packed), expected)


def test_two_callers_at_once_each_get_their_own_result(two_threads):
    problems = [_problem(seed) for seed in (1, 2)]
    expected = [_on_one_thread(lambda p=p: _linear(*p)) for p in problems]
    mismatches = []

    def caller(i: int) -> None:
        torch.set_num_threads(2)  # a new thread starts from torch's default
        for _ in range(50):
            if not torch.equal(_linear(*problems[i]), expected[i]):
                mismatches.append(i)

    callers = [threading.Thread(target=caller, args=(i,)) for i in range(2)]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in callers), "a caller hung"
    assert mismatches == []


@pytest.fixture
def yielding_helpers():
    previous = OPS.set_work_pool_yield(True)
    yield
    OPS.set_work_pool_yield(previous)


def test_helpers_that_yield_between_jobs_give_the_same_bits(two_threads, yielding_helpers):
    x, packed = _problem(4)
    expected = _on_one_thread(lambda: _linear(x, packed))
    for _ in range(20):
        assert torch.equal(_linear(x, packed), expected)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_packing_a_onednn_weight_makes_the_helpers_yield():
    from octavo_cpu import gemm

    previous = OPS.set_work_pool_yield(False)
    try:
        weight = torch.randn(64, 32)
        product = gemm.pack_onednn(weight)
        assert OPS.set_work_pool_yield(False) is True  # what pack_onednn left
        x = torch.randn(3, 32)
        torch.testing.assert_close(product(x), x @ weight.T)
    finally:
        OPS.set_work_pool_yield(previous)


def test_the_torch_gemm_choice_makes_the_helpers_yield(monkeypatch):
    from octavo_cpu import gemm

    monkeypatch.setenv(gemm.GEMM_ENV, "torch")  # F.linear: OpenMP's threads, as oneDNN's
    previous = OPS.set_work_pool_yield(False)
    try:
        assert gemm.linear_packer(torch.float32) is None
        assert OPS.set_work_pool_yield(False) is True
    finally:
        OPS.set_work_pool_yield(previous)


def _child(queue, x, packed) -> None:
    # Only the compiled kernel here: torch's own OpenMP ops hang in a child forked after the
    # parent ran them (libgomp), and a tensor through the queue does too; numpy goes through.
    queue.put((torch.get_num_threads(), _linear(x, packed).numpy()))


def test_a_forked_child_runs_the_kernels(two_threads):
    x, packed = _problem(3)
    expected = _linear(x, packed)  # the parent's helper is started now
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(queue, x, packed))
    child.start()
    threads, result = queue.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert threads == 2  # the child asks for a helper of its own
    assert torch.equal(torch.from_numpy(result), expected)
