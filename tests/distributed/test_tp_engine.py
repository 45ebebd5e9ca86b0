"""Tensor parallelism end to end through ``LLM``: TP = 2 gives TP = 1's greedy tokens exactly
(float32) on several shapes and on stories260K, samples alike with seeds, constrains output,
and its workers start, fail and stop as the engine's lifecycle says."""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys

import pytest
from tp_helpers import GREEDY, free_port, greedy_ids, make_llm, running, worker_pids

from octavo import SamplingParams
from octavo.distributed.executor import WorkerDiedError
from octavo.errors import ConfigError
from octavo.structured_output import StructuredOutputsParams

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("shape", ["gqa-untied", "kv1-tied", "qwen2-mha"])
def test_tp2_greedy_tokens_equal_tp1(tp_models, shape):
    one = make_llm(tp_models[shape], 1)
    expected = greedy_ids(one)
    llm = make_llm(tp_models[shape], 2)
    try:
        assert greedy_ids(llm) == expected
        # each rank sized its cache from its own bytes (half), for half the KV heads (or one)
        blocks = llm.engine.core.kv_cache_manager.block_pool.num_blocks
        one_blocks = one.engine.core.kv_cache_manager.block_pool.num_blocks
        assert blocks == (one_blocks if shape != "kv1-tied" else one_blocks // 2)
        processes = llm.engine.core.runner.processes
        assert len(processes) == 2 and all(p.is_alive() for p in processes)
    finally:
        llm.shutdown()


def test_tp2_on_gloo_alone_equals_tp1(tp_models, monkeypatch):
    """The all-reduce through gloo (OCTAVO_CPU_SHM=0: what ranks on different hosts use)."""
    expected = greedy_ids(make_llm(tp_models["gqa-untied"], 1))
    monkeypatch.setenv("OCTAVO_CPU_SHM", "0")
    llm = make_llm(tp_models["gqa-untied"], 2)
    try:
        assert greedy_ids(llm) == expected
    finally:
        llm.shutdown()


def test_stories260k_tp2_equals_tp1_with_seeded_sampling_and_structured_output(
    stories260k_path,
):
    texts = ["Once upon a time", "The little dog", "Lily wanted to", "One day, a boy named Tim"]
    seeded = [SamplingParams(temperature=0.9, top_k=40, seed=i, max_tokens=30) for i in range(4)]
    choice = SamplingParams(
        temperature=0.0,
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=["dragon", "princess"]),
    )

    def run(llm):
        greedy = [o.outputs[0].token_ids for o in llm.generate(texts, GREEDY, use_tqdm=False)]
        sampled = [o.outputs[0].text for o in llm.generate(texts, seeded, use_tqdm=False)]
        chosen = llm.generate(["The story is about a"], choice, use_tqdm=False)
        return greedy, sampled, chosen[0].outputs[0].text

    expected = run(make_llm(stories260k_path, 1))
    llm = make_llm(stories260k_path, 2)
    try:
        assert run(llm) == expected
        assert expected[2] in ("dragon", "princess")
    finally:
        llm.shutdown()


def test_ngram_speculation_at_tp2_keeps_the_greedy_tokens(tp_models):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    prompts = [[1, 5, 6, 7, 5, 6, 7, 5, 6], [1, 9, 9, 9, 9]]
    expected = greedy_ids(make_llm(tp_models["gqa-untied"], 1), prompts)
    llm = make_llm(tp_models["gqa-untied"], 2, speculative_config=spec)
    try:
        assert greedy_ids(llm, prompts) == expected
    finally:
        llm.shutdown()


def test_shutdown_and_garbage_collection_leave_no_worker(tp_models):
    llm = make_llm(tp_models["gqa-untied"], 2)
    pids = worker_pids(llm)
    assert len(running(pids)) == 2
    llm.shutdown()
    assert running(pids) == []
    llm.shutdown()  # idempotent
    with pytest.raises(WorkerDiedError, match="shut down"):
        greedy_ids(llm)

    llm = make_llm(tp_models["gqa-untied"], 2)
    pids = worker_pids(llm)
    del llm
    gc.collect()
    assert running(pids) == []


def test_a_killed_worker_makes_the_engine_dead_instead_of_hanging(tp_models):
    llm = make_llm(tp_models["gqa-untied"], 2)
    pids = worker_pids(llm)
    try:
        greedy_ids(llm)
        os.kill(pids[1], signal.SIGKILL)
        llm.engine.core.runner.processes[1].join(timeout=30)
        with pytest.raises(WorkerDiedError, match="rank 1"):
            greedy_ids(llm)
        assert "rank 1" in llm.engine.core.check_alive()
        with pytest.raises(WorkerDiedError):  # at once, every later call
            greedy_ids(llm)
    finally:
        llm.shutdown()
    assert running(pids) == []


def test_a_rank_that_fails_to_start_is_reported_with_its_error(tp_models, monkeypatch):
    monkeypatch.setenv("OCTAVO_DIST_TIMEOUT_S", "soon")
    with pytest.raises(ConfigError, match="rank [01] failed to start: ConfigError: OCTAVO_DIST_T"):
        make_llm(tp_models["gqa-untied"], 2)


def test_a_taken_rendezvous_port_is_refused_before_any_worker_starts(tp_models):
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"rendezvous port {port} is in use"):
            make_llm(tp_models["gqa-untied"], 2, master_port=port)


def test_two_nodes_on_loopback_equal_one_node(tp_models):
    model = tp_models["kv1-tied"]
    expected = greedy_ids(make_llm(model, 1))
    port = free_port()
    common = ["-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1"]
    common += ["--master-port", str(port), "--dtype", "float32", "--device", "cpu"]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "octavo.cli", "serve", str(model), *common, "--node-rank", "1"]
        + ["--kv-cache-memory", str(4 << 20), "--max-num-batched-tokens", "512"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        llm = make_llm(model, 2, nnodes=2, node_rank=0, master_port=port)
        assert len(llm.engine.core.runner.processes) == 1  # rank 0 here, rank 1 on "node 1"
        assert greedy_ids(llm) == expected
        llm.shutdown()
        try:
            code = node1.wait(timeout=60)
        except subprocess.TimeoutExpired:
            code = "still running after 60 s"
        if node1.poll() is None:
            node1.kill()
        assert code == 0, node1.stdout.read().decode()
    finally:
        if node1.poll() is None:
            node1.kill()
