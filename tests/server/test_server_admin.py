"""Servers with their own settings: API key, queue limit, preemption under a small KV cache, and
health when the engine loop stalls or dies."""

from __future__ import annotations

import asyncio
import time

import httpx2 as httpx
import openai
import pytest

from octavo import SamplingParams
from octavo.entrypoints.openai.serving_common import ServerConfig

from server_constants import MODEL_NAME  # noqa: E402  (tests/server/conftest.py)


def test_api_key_required_on_api_routes(server_factory):
    server = server_factory(ServerConfig(served_model_name=MODEL_NAME, api_key="s3cret", log_requests=False))
    with pytest.raises(openai.AuthenticationError) as denied:
        server.client(api_key="wrong").completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1)
    assert denied.value.status_code == 401 and denied.value.body["code"] == "invalid_api_key"
    ok = server.client(api_key="s3cret").completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1)
    assert ok.usage.completion_tokens == 1
    with httpx.Client(base_url=server.base_url) as http:
        missing = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert missing.status_code == 401 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
        assert missing.headers["x-request-id"]
        assert http.get("/v1/models").status_code == 401
        assert http.post("/tokenize", json={"prompt": "x"}).status_code == 401
        assert http.get("/health").status_code == 200, "probes stay open"
        assert http.get("/metrics").status_code == 200


def test_queue_limit_answers_503_with_retry_after(server_factory):
    config = ServerConfig(served_model_name=MODEL_NAME, max_queue_len=1, log_requests=False)
    server = server_factory(config, max_num_seqs=1)
    body = {"prompt": "once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as first, http.stream("POST", "/v1/completions", json=body) as second:
            assert first.status_code == 200 and second.status_code == 200
            third = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            assert third.status_code == 503 and third.headers["retry-after"] == "1"
            assert third.json()["error"]["code"] == "queue_full"
        server.wait_idle()
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
    metrics = server.metrics()
    assert metrics['octavo_requests_total{status="rejected"}'] == 1
    assert metrics['octavo_requests_total{status="aborted"}'] == 2


def test_preemption_under_a_small_kv_cache_keeps_greedy_output(server_factory, offline):
    server = server_factory(kv_cache_memory="256KiB")  # 32 blocks of 16 tokens for 8 requests of ~100 tokens
    prompts = [f"story number {i} once upon a time" for i in range(8)]
    params = dict(max_tokens=90, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].text for o in offline.generate(prompts, SamplingParams(**params), use_tqdm=False)]

    async def main():
        async with server.async_client() as client:
            responses = await asyncio.gather(*(
                client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=90, temperature=0, extra_body={"ignore_eos": True})
                for p in prompts
            ))
        return [r.choices[0].text for r in responses]

    assert asyncio.run(main()) == expected
    server.wait_idle()
    assert server.metrics()["octavo_num_requests_preempted_total"] > 0


def test_ready_fails_when_the_engine_stalls_while_health_stays_up(server_factory, monkeypatch):
    server = server_factory(ServerConfig(served_model_name=MODEL_NAME, ready_timeout=0.5, log_requests=False))
    runner = server.engine.core.runner
    execute = runner.execute_model

    def stalled(scheduler_output):
        time.sleep(1.5)  # a hung device: steps stop coming back in time
        return execute(scheduler_output)

    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        assert http.get("/health/ready").status_code == 200
        monkeypatch.setattr(runner, "execute_model", stalled)
        stuck = http.get("/health/ready")
        assert stuck.status_code == 503 and stuck.json()["error"]["code"] == "not_ready"
        assert http.get("/health").status_code == 200
        monkeypatch.setattr(runner, "execute_model", execute)
        server.wait_idle()  # the timed-out probe was aborted
        assert http.get("/health/ready").status_code == 200
    assert server.metrics()['octavo_requests_total{status="aborted"}'] == 0, "probes are not counted"


def test_health_503_after_the_engine_loop_dies(server_factory, monkeypatch):
    server = server_factory()
    runner = server.engine.core.runner

    def device_fault(scheduler_output):
        raise RuntimeError("simulated device fault")

    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        monkeypatch.setattr(runner, "execute_model", device_fault)
        failed = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert failed.status_code == 503 and "simulated device fault" in failed.json()["error"]["message"]
        stream = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True})
        assert stream.status_code == 503, "a dead engine refuses new streams before they start"
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert http.get("/health/ready").status_code == 503
    assert not server.async_engine.is_alive
    assert server.metrics()['octavo_requests_total{status="failed"}'] == 1
