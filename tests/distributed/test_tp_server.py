"""``octavo serve -tp 2`` over real HTTP with the official client: TP = 1's greedy tokens, a
SIGTERM that lets in-flight streams finish and leaves no worker behind, and a dead worker that
turns /health to 503 and fails requests with a clear error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from tp_helpers import free_port, make_llm, running

from octavo import SamplingParams

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")

pytestmark = pytest.mark.slow
PROMPTS = ["hello there", "a b c d e f", "once upon"]


def start_server(model, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "octavo.cli", "serve", str(model), "-tp", "2"]
    command += ["--device", "cpu"]
    command += ["--port", str(port), "--dtype", "float32", "--kv-cache-memory", str(4 << 20)]
    command += ["--max-num-batched-tokens", "512", "--disable-log-requests"]
    command += ["--uvicorn-log-level", "warning", "--shutdown-timeout", "60"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while True:
        assert process.poll() is None, process.stdout.read().decode()
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.2)


def worker_pids(server: subprocess.Popen) -> list[int]:
    children = psutil.Process(server.pid).children(recursive=True)
    return [c.pid for c in children if "resource_tracker" not in " ".join(c.cmdline())]


def test_served_tp2_equals_offline_tp1_and_sigterm_drains_and_stops_the_workers(tp_models):
    model = tp_models["gqa-untied"]
    offline = make_llm(model, 1)
    greedy = SamplingParams(temperature=0.0, max_tokens=20)
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, greedy, use_tqdm=False)]
    port = free_port()
    server = start_server(model, port)
    try:
        pids = worker_pids(server)
        assert len(pids) == 2
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        texts = [
            client.completions.create(model=str(model), prompt=p, max_tokens=20, temperature=0)
            .choices[0]
            .text
            for p in PROMPTS
        ]
        assert texts == expected
        results: list = [None] * 4
        started = threading.Barrier(5)

        def stream(i: int) -> None:
            chunks = client.completions.create(
                model=str(model),
                prompt=PROMPTS[i % 3],
                max_tokens=120,
                temperature=0,
                extra_body={"ignore_eos": True},
                stream=True,
            )
            received = [next(iter(chunks))]
            started.wait()
            received += list(chunks)
            results[i] = received

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        started.wait(timeout=120)
        server.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=120)
        assert server.wait(timeout=120) == 0
        assert running(pids) == []
        assert all(r is not None and r[-1].choices[0].finish_reason == "length" for r in results)
    finally:
        if server.poll() is None:
            server.kill()


def test_a_dead_worker_turns_health_to_503_and_fails_requests_clearly(tp_models):
    model = tp_models["gqa-untied"]
    port = free_port()
    server = start_server(model, port)
    base = f"http://127.0.0.1:{port}"
    try:
        pids = worker_pids(server)
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while httpx.get(f"{base}/health", timeout=5).status_code == 200:
            assert time.monotonic() < deadline, "/health still says ok"
            time.sleep(0.2)
        health = httpx.get(f"{base}/health", timeout=5)
        assert health.status_code == 503 and "rank" in health.json()["error"]["message"]
        answer = httpx.post(
            f"{base}/v1/completions",
            json={"model": str(model), "prompt": "hi", "max_tokens": 4},
            timeout=30,
        )
        assert answer.status_code >= 500 and "rank" in answer.text
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        finally:
            if server.poll() is None:
                server.kill()
    assert running(pids) == []


def test_workers_of_a_killed_server_exit_on_their_own(tp_models):
    server = start_server(tp_models["gqa-untied"], free_port())
    pids = worker_pids(server)
    server.kill()  # no shutdown runs: each worker sees its parent gone
    server.wait(timeout=30)
    deadline = time.monotonic() + 30
    while running(pids):
        assert time.monotonic() < deadline, f"workers {running(pids)} outlived the server"
        time.sleep(0.2)
