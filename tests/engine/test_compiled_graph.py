"""``--no-enforce-eager``: the forward compiled by torch.compile where the platform can, said
loudly where it cannot."""

from __future__ import annotations

import logging

import pytest
import torch
from engine_helpers import generate_ids, make_llm, shared_prefix_prompts

from octavo import SamplingParams
from octavo_cpu import kernels, plugin


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_the_compiled_forward_keeps_greedy_tokens_and_compiles_only_at_start_up(
    tiny_model, tmp_path
):
    if kernels.load_kernels().ops is None:
        pytest.skip("the compiled kernels do not run here: --no-enforce-eager runs eagerly")
    torch._dynamo.reset()
    cache = tmp_path / "compile-cache"
    compiled = make_llm(tiny_model, enforce_eager=False, compile_cache_dir=str(cache))
    forward = compiled.engine.core.runner.forward
    assert forward.compiled and forward.model.cache_dir == cache
    assert any(cache.iterdir()), "inductor keeps what it compiled in the cache folder"
    graphs_at_start = compiled_graphs()
    assert graphs_at_start >= 1

    eager = make_llm(tiny_model)
    assert not getattr(eager.engine.core.runner.forward, "compiled", False)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = shared_prefix_prompts(9, seed=3)
    for batch in (prompts, prompts[:1], prompts[2:5]):  # mixed steps, one request, a few
        assert generate_ids(compiled, batch, params) == generate_ids(eager, batch, params)
    assert compiled_graphs() == graphs_at_start, "a request compiled a graph of its own"


def test_without_the_compiled_kernels_the_runner_says_it_runs_eagerly(
    tiny_model, monkeypatch, caplog
):
    monkeypatch.setattr(plugin, "load_kernels", lambda: kernels._load("torch"))
    with caplog.at_level(logging.WARNING, logger="octavo.model_executor.model_runner"):
        llm = make_llm(tiny_model, enforce_eager=False)
    assert not getattr(llm.engine.core.runner.forward, "compiled", False)
    assert "--no-enforce-eager" in caplog.text and "runs eagerly" in caplog.text
