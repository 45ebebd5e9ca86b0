"""``--speculative-config`` over HTTP: streams carry the tokens of decoding without speculation,
the octavo_spec_decode_* metrics count the drafts, a client leaving mid-stream frees every
block, and a bad config stops ``octavo serve`` at start-up with the reason."""

from __future__ import annotations

import asyncio
import json

import httpx2 as httpx
import pytest
from engine_gate import EngineGate, pending_commands, requests_in_engine, serving_context, wait_for  # noqa: E402  (tests/server/engine_gate.py)

from octavo import SamplingParams
from octavo.cli import main

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "adaptive": False,  # every draft scheduled, whatever the machine's speed
}
PROMPTS = ["once upon a time", "the dog ran to the park", "lily saw a big red ball"]


@pytest.fixture
def spec_server(server_factory):
    return server_factory(speculative_config=NGRAM)


def test_streams_with_ngram_speculation_carry_the_offline_text(spec_server, offline):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = {o.prompt: o.outputs[0].text for o in offline.generate(PROMPTS, params)}

    async def one(client, prompt: str) -> str:
        stream = await client.completions.create(
            model="tiny-llama",
            prompt=prompt,
            max_tokens=40,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run() -> list[str]:
        async with spec_server.async_client() as client:
            return await asyncio.gather(*(one(client, PROMPTS[i % 3]) for i in range(12)))

    assert asyncio.run(run()) == [expected[PROMPTS[i % 3]] for i in range(12)]
    spec_server.wait_idle()
    metrics = spec_server.metrics()
    drafts = metrics["octavo_spec_decode_num_draft_tokens_total"]
    accepted = metrics["octavo_spec_decode_num_accepted_tokens_total"]
    assert metrics["octavo_spec_decode_num_drafts_total"] > 0 and 0 < accepted <= drafts
    per_pos = [
        value
        for name, value in metrics.items()
        if name.startswith("octavo_spec_decode_num_accepted_tokens_per_pos_total")
    ]
    assert sum(per_pos) == accepted
    stats = spec_server.engine.core.scheduler.spec_stats
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (drafts, accepted)


def test_clients_leaving_mid_stream_free_every_block(spec_server):
    """As in test_server_ops: the engine is held once every request has streamed, so none can
    finish before its client leaves, however fast the machine."""
    body = {
        "prompt": "once upon a time",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }

    def hold(_: int) -> bool:
        requests = requests_in_engine(spec_server.engine)
        return not pending_commands(spec_server.async_engine) and all(
            r.num_output_tokens > 0 for r in requests
        )

    async def leave_after_first_chunk(http: httpx.AsyncClient) -> None:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    return

    async def run() -> None:
        async with httpx.AsyncClient(base_url=spec_server.base_url, timeout=60) as http:
            await asyncio.gather(*(leave_after_first_chunk(http) for _ in range(10)))

    with EngineGate(spec_server.engine, hold=hold):
        asyncio.run(run())
        wait_for(lambda: serving_context(spec_server).num_admitted == 0)
    spec_server.wait_idle()
    assert spec_server.metrics()['octavo_requests_total{status="aborted"}'] == 10


def test_a_bad_speculative_config_stops_serve_at_start_up(server_model, capsys):
    bad = '{"method": "ngram", "num_speculative_tokens": 0}'
    assert main(["serve", str(server_model), "--speculative-config", bad]) == 2
    assert "speculative_config.num_speculative_tokens must be an integer >= 1" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit) as exit_info:  # argparse refuses text that is not JSON
        main(["serve", str(server_model), "--speculative-config", "{method"])
    assert exit_info.value.code == 2
    assert "argument --speculative-config: not valid JSON" in capsys.readouterr().err


def test_bench_serve_reports_the_servers_acceptance(spec_server, server_model, tmp_path):
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--base-url", spec_server.base_url, "--tokenizer",
            str(server_model), "--max-concurrency", "2", "--num-prompts", "4", "--input-len",
            "8", "16", "--output-len", "24", "24", "--disable-tqdm",
            "--output-json", str(out)]  # fmt: skip
    assert main(argv) == 0
    (run,) = json.loads(out.read_text())["runs"]
    stats = spec_server.engine.core.scheduler.spec_stats
    assert run["spec_num_drafts"] > 0 and 0 < run["spec_acceptance_rate"] <= 1
    assert run["spec_num_drafts"] <= stats.num_drafts  # the warm-up request is not counted
