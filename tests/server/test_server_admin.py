"""Servers with their own settings: API key, queue limit, preemption under a small KV cache, and
health when the engine loop stalls or dies."""

from __future__ import annotations

import asyncio
import threading

import httpx2 as httpx
import openai
import pytest
from engine_gate import EngineGate, pending_commands, requests_in_engine, serving_context, wait_for  # noqa: E402  (tests/server/engine_gate.py)
from server_constants import MODEL_NAME  # noqa: E402  (tests/server/conftest.py)

from octavo import SamplingParams
from octavo.entrypoints.openai.serving_common import ServerConfig


def test_api_key_required_on_api_routes(server_factory):
    server = server_factory(
        ServerConfig(served_model_name=MODEL_NAME, api_key="s3cret", log_requests=False)
    )
    with pytest.raises(openai.AuthenticationError) as denied:
        server.client(api_key="wrong").completions.create(
            model=MODEL_NAME, prompt="hi", max_tokens=1
        )
    assert denied.value.status_code == 401 and denied.value.body["code"] == "invalid_api_key"
    ok = server.client(api_key="s3cret").completions.create(
        model=MODEL_NAME, prompt="hi", max_tokens=1
    )
    assert ok.usage.completion_tokens == 1
    with httpx.Client(base_url=server.base_url) as http:
        missing = http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        assert missing.status_code == 401 and set(missing.json()["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }
        assert missing.headers["x-request-id"]
        assert http.get("/v1/models").status_code == 401
        assert http.post("/tokenize", json={"prompt": "x"}).status_code == 401
        assert http.get("/health").status_code == 200, "probes stay open"
        assert http.get("/metrics").status_code == 200


def test_queue_limit_answers_503_with_retry_after(server_factory):
    config = ServerConfig(served_model_name=MODEL_NAME, max_queue_len=1, log_requests=False)
    server = server_factory(config, max_num_seqs=1)
    body = {"prompt": "once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
    # The engine is held in its first step until both streams are given up, so neither can
    # finish (and free its room) first, however fast the machine is.
    with httpx.Client(base_url=server.base_url, timeout=60) as http, EngineGate(server.engine):
        with (
            http.stream("POST", "/v1/completions", json=body) as first,
            http.stream("POST", "/v1/completions", json=body) as second,
        ):
            assert first.status_code == 200 and second.status_code == 200
            third = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
            assert third.status_code == 503 and third.headers["retry-after"] == "1"
            assert third.json()["error"]["code"] == "queue_full"
        wait_for(
            lambda: serving_context(server).num_admitted == 0
        )  # both streams closed: both aborts sent
    server.wait_idle()
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        assert (
            http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
        )
    metrics = server.metrics()
    assert metrics['octavo_requests_total{status="rejected"}'] == 1
    assert metrics['octavo_requests_total{status="aborted"}'] == 2
    assert metrics['octavo_requests_total{status="finished"}'] == 1  # the last "hi"


def test_preemption_under_a_small_kv_cache_keeps_greedy_output(server_factory, offline):
    server = server_factory(
        kv_cache_memory="256KiB"
    )  # 32 blocks of 16 tokens for 8 requests of ~100 tokens
    prompts = [f"story number {i} once upon a time" for i in range(8)]
    params = dict(max_tokens=90, temperature=0, ignore_eos=True)
    expected = [
        o.outputs[0].text
        for o in offline.generate(prompts, SamplingParams(**params), use_tqdm=False)
    ]

    def hold(_: int) -> bool:
        # Until all 8 are in the engine, the early ones step only when a command waits (at most
        # one step per request): they run together and outgrow the cache, however the arrivals
        # spread against the machine's speed.
        if len(requests_in_engine(server.engine)) == len(prompts):
            gate.release()
        return not pending_commands(server.async_engine)

    async def main():
        async with server.async_client() as client:
            responses = await asyncio.gather(
                *(
                    client.completions.create(
                        model=MODEL_NAME,
                        prompt=p,
                        max_tokens=90,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    for p in prompts
                )
            )
        return [r.choices[0].text for r in responses]

    with EngineGate(server.engine, hold=hold) as gate:
        assert asyncio.run(main()) == expected
    server.wait_idle()
    assert server.metrics()["octavo_num_requests_preempted_total"] > 0


def test_ready_fails_when_the_engine_stalls_while_health_stays_up(server_factory):
    # ready_timeout bounds one greedy step of a warm engine (ms): a generous deadline, not a bet;
    # the stall is a held forward, so the stuck probe cannot beat its timeout however fast the
    # machine is.
    server = server_factory(
        ServerConfig(served_model_name=MODEL_NAME, ready_timeout=2.0, log_requests=False)
    )
    server.client().completions.create(
        model=MODEL_NAME, prompt="hi", max_tokens=1
    )  # the first step may compile kernels
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        assert http.get("/health/ready").status_code == 200
        with EngineGate(
            server.engine
        ):  # a hung device: the probe's step does not come back until released
            stuck = http.get("/health/ready")
            assert stuck.status_code == 503 and stuck.json()["error"]["code"] == "not_ready"
            assert http.get("/health").status_code == 200
        server.wait_idle()  # the timed-out probe was aborted
        assert http.get("/health/ready").status_code == 200
    assert server.metrics()['octavo_requests_total{status="aborted"}'] == 0, (
        "probes are not counted"
    )


def test_a_request_the_step_fails_gets_500_alone_and_streams_in_flight_keep_their_text(
    server_factory, offline, monkeypatch
):
    from octavo.model_executor import logits_processors

    server = server_factory()
    original = logits_processors.SamplingPenalties._apply

    def fault_for_one_request(self, row_logits, params, batch, row, num_tokens):
        if params.repetition_penalty == 1.25:
            raise RuntimeError("simulated fault in one request's penalties")
        return original(self, row_logits, params, batch, row, num_tokens)

    monkeypatch.setattr(logits_processors.SamplingPenalties, "_apply", fault_for_one_request)
    prompts = ["once upon a time", "the little dog"]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].text for o in offline.generate(prompts, params, use_tqdm=False)]
    body = {"max_tokens": 40, "temperature": 0, "extra_body": {"ignore_eos": True}}

    bad_queued = threading.Event()

    def both_streams_decoding(_: int) -> bool:  # hold the engine there until the bad one is queued
        requests = requests_in_engine(server.engine)
        return (
            not bad_queued.is_set()
            and len(requests) == 2
            and all(r.num_output_tokens for r in requests)
        )

    async def run():
        client = server.async_client()
        with EngineGate(server.engine, hold=both_streams_decoding) as gate:
            streams = [
                await client.completions.create(model=MODEL_NAME, prompt=p, stream=True, **body)
                for p in prompts
            ]
            texts = [[] for _ in prompts]

            async def read(i):
                async for chunk in streams[i]:
                    texts[i].append(chunk.choices[0].text if chunk.choices else "")

            readers = [asyncio.ensure_future(read(i)) for i in range(len(prompts))]
            await asyncio.to_thread(gate.wait_held)
            bad = asyncio.ensure_future(
                client.completions.create(
                    model=MODEL_NAME,
                    prompt="hi",
                    max_tokens=4,
                    extra_body={"repetition_penalty": 1.25},
                )
            )
            # released once the bad request is queued: it joins the streams' next step
            await asyncio.to_thread(wait_for, lambda: pending_commands(server.async_engine) == 1)
            bad_queued.set()
        with pytest.raises(openai.InternalServerError) as failed:
            await bad
        await asyncio.gather(*readers)
        return failed.value, ["".join(t) for t in texts]

    invalid_before = server.metrics()['octavo_requests_total{status="invalid"}']
    failed, texts = asyncio.run(run())
    assert failed.status_code == 500 and failed.body["code"] == "request_failed"
    assert "simulated fault" in failed.body["message"]
    assert texts == expected
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        assert http.get("/health").status_code == 200
    metrics = server.metrics()
    assert metrics['octavo_requests_total{status="failed"}'] == 1
    assert metrics['octavo_requests_total{status="invalid"}'] == invalid_before, (
        "a 500 is not also invalid"
    )
    server.wait_idle()


def test_health_503_after_the_engine_loop_dies(server_factory, monkeypatch):
    server = server_factory()
    runner = server.engine.core.runner

    def device_fault(scheduler_output):
        raise RuntimeError("simulated device fault")

    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        monkeypatch.setattr(runner, "execute_model", device_fault)
        failed = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert (
            failed.status_code == 503
            and "simulated device fault" in failed.json()["error"]["message"]
        )
        stream = http.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True}
        )
        assert stream.status_code == 503, "a dead engine refuses new streams before they start"
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert http.get("/health/ready").status_code == 503
    assert not server.async_engine.is_alive
    assert server.metrics()['octavo_requests_total{status="failed"}'] == 1
