"""The cpu platform's per-step thread count: small steps on one thread, large ones on all."""

from __future__ import annotations

import pytest
import torch

from octavo_cpu import plugin
from octavo_cpu.threads import SERIAL_TOKENS_ENV, StepThreads, ThreadedForward


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_small_steps_run_on_one_thread():
    threads = StepThreads(max_threads=4, serial_tokens=16)
    assert [threads.for_tokens(n) for n in (1, 15, 16, 512)] == [1, 1, 4, 4]
    assert StepThreads(max_threads=4, serial_tokens=0).for_tokens(1) == 4


def test_the_cut_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(SERIAL_TOKENS_ENV, "32")
    assert StepThreads.from_env().serial_tokens == 32
    assert StepThreads.from_env().max_threads == torch.get_num_threads()
    monkeypatch.setenv(SERIAL_TOKENS_ENV, "0")
    assert "for every step" in StepThreads.from_env().describe()


@pytest.mark.parametrize("raw", ["-1", "many"])
def test_a_bad_cut_is_refused_with_what_to_give(monkeypatch, raw):
    monkeypatch.setenv(SERIAL_TOKENS_ENV, raw)
    with pytest.raises(ValueError, match=f"{SERIAL_TOKENS_ENV}='{raw}'.*token count >= 0"):
        StepThreads.from_env()
    assert "not usable" in plugin.describe_threads()


def test_the_forward_sets_each_steps_threads_before_the_model_runs(restore_threads):
    seen = []

    def model(input_ids, positions, metadata):
        seen.append(torch.get_num_threads())
        return input_ids

    forward = ThreadedForward(model, StepThreads(max_threads=2, serial_tokens=8))
    for num_tokens in (1, 64, 3):
        ids = torch.zeros(num_tokens, dtype=torch.long)
        assert forward(ids, ids, None) is ids
    assert seen == [1, 2, 1]


def test_octavo_env_reports_the_thread_policy(monkeypatch):
    monkeypatch.setenv(SERIAL_TOKENS_ENV, "16")
    assert f"threads: {plugin.describe_threads()}" in plugin.octavo_platform_detect().reason
    described = StepThreads(max_threads=2, serial_tokens=16).describe()
    assert "1 for steps under 16 tokens" in described and SERIAL_TOKENS_ENV in described
