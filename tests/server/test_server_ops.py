"""Concurrency, disconnects, prefix-cache isolation by cache_salt, and /metrics against the
requests actually sent."""

from __future__ import annotations

import asyncio
import random

import httpx2 as httpx
import pytest
from engine_gate import EngineGate, pending_commands, requests_in_engine, serving_context, wait_for  # noqa: E402  (tests/server/engine_gate.py)

from octavo import SamplingParams
from octavo.metrics import EngineMetrics

PROMPTS = [
    "once upon a time",
    "the dog ran to the park",
    "lily saw a big red ball",
    "tom and his mom went home",
]


def test_64_concurrent_streams_complete_with_offline_text(server, offline):
    expected = {
        o.prompt: o.outputs[0].text
        for o in offline.generate(
            PROMPTS, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False
        )
    }

    async def one(client, prompt: str) -> str:
        stream = await client.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def main() -> list[str]:
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, PROMPTS[i % 4]) for i in range(64)))

    texts = asyncio.run(main())
    assert texts == [expected[PROMPTS[i % 4]] for i in range(64)]
    server.wait_idle()


def test_50_clients_disconnecting_mid_stream_free_every_block(server):
    """No request can run to its end before its client leaves, however fast the machine: the
    engine is held in any step that would only extend requests that already streamed a token,
    unless a command (a new request, an abort) waits for it. So it runs at most one step per
    request and per command (<= 150) of the 240 each request would need."""
    before = server.metrics()
    max_tokens = 240
    body = {
        "prompt": "once upon a time",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }

    def hold(_: int) -> bool:
        requests = requests_in_engine(server.engine)
        return not pending_commands(server.async_engine) and all(
            r.num_output_tokens > 0 for r in requests
        )

    async def leave_after_first_chunk(http: httpx.AsyncClient) -> None:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    return  # closing an unread stream closes the connection

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            await asyncio.gather(*(leave_after_first_chunk(http) for _ in range(50)))

    with EngineGate(server.engine, hold=hold) as gate:
        asyncio.run(main())
        wait_for(
            lambda: serving_context(server).num_admitted == 0
        )  # every stream closed: every abort sent
    server.wait_idle()
    wait_for(lambda: server.metrics()["octavo_kv_cache_usage_ratio"] == 0.0)
    after = server.metrics()
    assert (
        after['octavo_requests_total{status="aborted"}']
        - before['octavo_requests_total{status="aborted"}']
        == 50
    )
    assert (
        after['octavo_requests_total{status="finished"}']
        == before['octavo_requests_total{status="finished"}']
    )
    assert after["octavo_num_requests_running"] == 0 and after["octavo_num_requests_waiting"] == 0
    assert gate.num_forwards < max_tokens, "the engine ran fewer steps than one request needs"


def test_non_streaming_client_that_gives_up_aborts_its_request(server):
    """The client's timeout fires while its request provably runs: the engine is held inside its
    4th step (as by a hung device) until the server has given the request up, so the outcome does
    not depend on how fast the machine generates."""
    before = server.metrics()
    max_tokens, passes = 240, 3
    body = {
        "prompt": "once upon a time",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }

    async def give_up() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            post = asyncio.ensure_future(http.post("/v1/completions", json=body))
            await asyncio.to_thread(gate.wait_held)
            assert server.metrics()["octavo_num_requests_running"] == 1, "the request runs"
            with pytest.raises(asyncio.TimeoutError):
                # The engine is held until the server gives the request up, so on any machine
                # the post cannot complete and the timeout fires; it cancels the post (closing
                # its connection). The 0.2 s is only how long the client waits first.
                await asyncio.wait_for(post, timeout=0.2)

    with EngineGate(server.engine, passes=passes) as gate:
        asyncio.run(give_up())
        assert server.engine.has_unfinished_requests(), (
            "a held engine cannot have finished the request"
        )
        wait_for(
            lambda: serving_context(server).num_admitted == 0
        )  # the server gave up too: its abort is sent
    server.wait_idle()
    wait_for(
        lambda: (
            server.metrics()['octavo_requests_total{status="aborted"}']
            == before['octavo_requests_total{status="aborted"}'] + 1
        )
    )
    after = server.metrics()
    assert (
        after['octavo_requests_total{status="finished"}']
        == before['octavo_requests_total{status="finished"}']
    )
    # the abort landed at the first step boundary after the client left: at most the held
    # step's token more
    assert (
        after["octavo_tokens_generated_total"] - before["octavo_tokens_generated_total"]
        <= passes + 1
        < max_tokens
    )


def test_cache_salt_separates_tenants_in_the_prefix_cache(server):
    rng = random.Random(5)
    prompt = [1] + [
        rng.randrange(3, 512) for _ in range(39)
    ]  # 40 tokens: two full blocks of 16 cacheable
    hits_key = "octavo_prefix_cache_hits_total"

    def run(salt):
        extra = {} if salt is None else {"cache_salt": salt}
        before = server.metrics()[hits_key]
        server.client().completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=2, temperature=0, extra_body=extra
        )
        server.wait_idle()
        return server.metrics()[hits_key] - before

    assert run("tenant-a") == 0
    assert run("tenant-b") == 0, "another tenant must not hit tenant-a's blocks"
    assert run(None) == 0, "no salt is its own tenant"
    assert run("tenant-a") == 32, "the same tenant hits its own two full blocks"
    assert run("tenant-b") == 32
    assert run(None) == 32


def streamed_chat_usage(client):
    """A streamed 3-token greedy chat completion's usage."""
    stream = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=3,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    return [c for c in stream][-1].usage


def test_metrics_agree_with_the_requests_sent(server):
    before = server.metrics()
    client = server.client()
    usages = [
        client.completions.create(
            model="tiny-llama", prompt=PROMPTS[:2], max_tokens=5, temperature=0
        ).usage,
        client.completions.create(
            model="tiny-llama", prompt=PROMPTS[2], max_tokens=4, n=2, temperature=0.8, seed=3
        ).usage,
    ]
    usages.append(streamed_chat_usage(client))
    with httpx.Client(base_url=server.base_url) as http:
        statuses = [
            http.post("/v1/completions", json={"prompt": "hi", "n": 0}).status_code,
            http.post("/v1/chat/completions", json={"messages": []}).status_code,
            http.post("/v1/completions", json={"prompt": "hi", "model": "other"}).status_code,
        ]
    assert statuses == [400, 400, 404]
    server.wait_idle()
    wait_for(lambda: server.metrics()["octavo_kv_cache_usage_ratio"] == 0.0)
    after = server.metrics()

    def delta(key: str) -> float:
        return after[key] - before.get(key, 0.0)

    assert delta('octavo_requests_total{status="finished"}') == 4  # one per prompt
    assert delta('octavo_requests_total{status="invalid"}') == 3
    assert delta('octavo_requests_total{status="rejected"}') == 0
    assert (
        delta("octavo_tokens_generated_total")
        == sum(u.completion_tokens for u in usages)
        == 10 + 8 + 3
    )
    assert delta("octavo_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("octavo_time_to_first_token_seconds_count") == 4
    assert delta("octavo_request_latency_seconds_count") == 4
    assert delta("octavo_inter_token_latency_seconds_count") == 4
    assert after["octavo_num_requests_running"] == 0 and after["octavo_kv_cache_usage_ratio"] == 0.0
    for name in (
        "octavo_num_requests_preempted_total",
        "octavo_prefix_cache_queries_total",
        "octavo_num_requests_waiting",
    ):
        assert name in after


def test_vllm_naming_counts_the_same_quantities_under_vllms_names(
    module_server_factory, server_model
):
    """``--metrics-naming vllm``: vLLM v1's names, its model_name and engine labels, finish
    reasons, and one inter-token observation per step after a request's first token."""
    running = module_server_factory(
        server_model, None, metrics=EngineMetrics(naming="vllm", model_name="tiny-llama")
    )
    before = running.metrics()
    client = running.client()
    usages = [
        client.completions.create(
            model="tiny-llama", prompt=PROMPTS[:2], max_tokens=5, temperature=0
        ).usage
    ]
    usages.append(streamed_chat_usage(client))
    with httpx.Client(base_url=running.base_url) as http:
        assert http.post("/v1/completions", json={"prompt": "hi", "n": 0}).status_code == 400
    running.wait_idle()
    labels = 'engine="0",model_name="tiny-llama"'
    wait_for(lambda: running.metrics()[f"vllm:kv_cache_usage_perc{{{labels}}}"] == 0.0)
    after = running.metrics()

    def delta(name: str, extra: str = "") -> float:  # the conftest's keys: labels sorted
        key = f"{name}{{{','.join(sorted([*labels.split(','), *filter(None, [extra])]))}}}"
        return after[key] - before.get(key, 0.0)

    tokens = sum(u.completion_tokens for u in usages)
    assert tokens == 13
    assert delta("vllm:generation_tokens_total") == tokens
    assert delta("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("vllm:request_success_total", 'finished_reason="length"') == 3
    assert delta("vllm:request_success_total", 'finished_reason="abort"') == 0
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta("vllm:request_time_per_output_token_seconds_count") == 3
    assert delta("vllm:inter_token_latency_seconds_count") == tokens - 3  # a token a step
    assert delta("octavo_requests_total", 'status="finished"') == 3
    assert delta("octavo_requests_total", 'status="invalid"') == 1
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:spec_decode_num_drafts_total",
    ):
        assert f"{name}{{{labels}}}" in after, name
    assert not any(key.startswith("octavo_tokens") for key in after)


def test_an_unknown_metrics_naming_is_refused():
    with pytest.raises(ValueError, match="metrics naming must be one of"):
        EngineMetrics(naming="prometheus")


def test_metrics_endpoint_is_prometheus_text(server):
    with httpx.Client(base_url=server.base_url) as http:
        response = http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    assert "# TYPE octavo_request_latency_seconds histogram" in response.text
