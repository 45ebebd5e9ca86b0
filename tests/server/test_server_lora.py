"""LoRA adapters over real HTTP with the official openai client: ``--lora-modules`` (both
forms), ``/v1/models`` listing them with their parent, ``model`` naming an adapter (outputs equal
the offline engine's with the same LoRARequest), and vLLM's load/unload endpoints at run time
while other requests stream, with every bad input a 400/404 naming its field."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import httpx2 as httpx
import pytest
from cli_server import cli_server  # noqa: E402  (tests/server/cli_server.py)
from server_constants import ENGINE_DEFAULTS, MODEL_NAME  # noqa: E402

from octavo import LLM, LoRARequest, SamplingParams
from octavo.entrypoints.openai.serve import register_lora_modules
from octavo.entrypoints.openai.serving_common import ServerConfig
from octavo.testing.tiny_models import TinyModelSpec, write_tiny_model

pytest.importorskip("peft", reason="the adapters are made by PEFT (pip install peft)")
from octavo.testing.tiny_lora import write_random_lora  # noqa: E402

LORA_ARGS = dict(enable_lora=True, max_loras=2, max_lora_rank=16)
PROMPT = [1, 17, 33, 90, 4, 200, 11]


@pytest.fixture(scope="module")
def adapters(server_model, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("server_lora")
    made = {
        "sql": write_random_lora(root / "sql", server_model, rank=8, seed=1),
        "chat": write_random_lora(
            root / "chat", server_model, rank=16, target_modules=("q_proj", "down_proj"), seed=2
        ),
        "extra": write_random_lora(root / "extra", server_model, rank=4, seed=3),
        "too-wide": write_random_lora(root / "too-wide", server_model, rank=32, seed=4),
    }
    other = write_tiny_model(
        root / "other-base", TinyModelSpec(hidden_size=32, num_attention_heads=2, seed=5)
    )
    made["other-base"] = write_random_lora(root / "for-other", other, rank=8, seed=6)
    return made


@pytest.fixture(scope="module")
def offline_lora(server_model) -> LLM:
    return LLM(str(server_model), **ENGINE_DEFAULTS, **LORA_ARGS)


def offline_text(llm: LLM, adapters, name, max_tokens=8) -> str:
    lora = None if name is None else LoRARequest(name, 100 + len(name), str(adapters[name]))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], params, lora_request=lora, use_tqdm=False)
    return out.outputs[0].text


@pytest.fixture(scope="module")
def lora_server(module_server_factory, server_model, adapters):
    config = ServerConfig(
        served_model_name=MODEL_NAME, log_requests=False, allow_runtime_lora_updating=True
    )
    running = module_server_factory(server_model, config, **LORA_ARGS)
    modules = [{"name": n, "path": str(adapters[n])} for n in ("sql", "chat")]
    register_lora_modules(running.engine, modules, MODEL_NAME)
    return running


def completion_text(client, model: str, max_tokens=8) -> str:
    response = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert response.model == model
    return response.choices[0].text


def test_models_lists_the_adapters_with_their_parent(lora_server, adapters):
    cards = {card.id: card for card in lora_server.client().models.list().data}
    assert set(cards) == {MODEL_NAME, "sql", "chat"}
    for name in ("sql", "chat"):
        assert cards[name].parent == MODEL_NAME and cards[name].root == str(adapters[name])
    assert lora_server.client().models.retrieve("sql").parent == MODEL_NAME


def test_model_names_the_adapter_and_outputs_equal_offline(lora_server, adapters, offline_lora):
    client = lora_server.client()
    outputs = {name: completion_text(client, name or MODEL_NAME) for name in (None, "sql", "chat")}
    for name, tokens in outputs.items():
        assert tokens == offline_text(offline_lora, adapters, name), name
    assert outputs["sql"] != outputs[None] and outputs["chat"] != outputs[None]
    chat = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert chat.model == "chat"
    with pytest.raises(Exception) as info:
        completion_text(client, "no-such-adapter")
    assert info.value.status_code == 404 and info.value.body["param"] == "model"
    assert "sql" in info.value.body["message"]


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/{route}", json=body, timeout=30)


def test_load_serve_unload_reload_while_others_stream(lora_server, adapters, offline_lora):
    client = lora_server.client()
    errors, finished = [], []

    def stream(model: str) -> None:
        try:
            chunks = client.completions.create(
                model=model,
                prompt=PROMPT,
                max_tokens=60,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            finished.append(sum(1 for _ in chunks))
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    streams = [threading.Thread(target=stream, args=(m,)) for m in (MODEL_NAME, "sql", MODEL_NAME)]
    for thread in streams:
        thread.start()
    loaded = post(
        lora_server,
        "load_lora_adapter",
        {"lora_name": "extra", "lora_path": str(adapters["extra"])},
    )
    assert loaded.status_code == 200, loaded.text
    assert completion_text(client, "extra") == offline_text(offline_lora, adapters, "extra")
    assert post(lora_server, "unload_lora_adapter", {"lora_name": "extra"}).status_code == 200
    for thread in streams:
        thread.join(timeout=60)
    assert not errors and len(finished) == 3
    gone = post(lora_server, "unload_lora_adapter", {"lora_name": "extra"})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"
    with pytest.raises(Exception) as info:
        completion_text(client, "extra")
    assert info.value.status_code == 404
    again = post(
        lora_server,
        "load_lora_adapter",
        {"lora_name": "extra", "lora_path": str(adapters["extra"])},
    )
    assert again.status_code == 200
    assert completion_text(client, "extra") == offline_text(offline_lora, adapters, "extra")
    lora_server.wait_idle()
    usage = lora_server.metrics()["octavo_kv_cache_usage_ratio"]
    assert usage == 0.0


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"lora_name": "x", "lora_path": "/no/such/folder"}, "lora_path", "invalid_lora_adapter"),
        ({"lora_name": "x", "lora_path": "@too-wide"}, "lora_path", "invalid_lora_adapter"),
        ({"lora_name": "x", "lora_path": "@other-base"}, "lora_path", "invalid_lora_adapter"),
        ({"lora_name": "chat", "lora_path": "@sql"}, "lora_name", "lora_already_loaded"),
        ({"lora_name": MODEL_NAME, "lora_path": "@sql"}, "lora_name", None),
        ({"lora_name": "x"}, "lora_path", None),
    ],
    ids=["missing", "rank-above-max", "another-base", "name-taken", "base-name", "no-path"],
)
def test_bad_loads_are_400s_naming_the_field(lora_server, adapters, body, param, code):
    body = {k: str(adapters[v[1:]]) if str(v).startswith("@") else v for k, v in body.items()}
    response = post(lora_server, "load_lora_adapter", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and (code is None or error["code"] == code), error
    assert {card.id for card in lora_server.client().models.list().data} >= {"sql", "chat"}


def test_runtime_updates_are_off_unless_allowed(server_factory, adapters):
    running = server_factory(**LORA_ARGS)
    response = post(
        running, "load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters["sql"])}
    )
    assert response.status_code == 404
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in response.json()["error"]["message"]


def test_a_load_without_enable_lora_is_a_400(server_factory, adapters):
    config = ServerConfig(
        served_model_name=MODEL_NAME, log_requests=False, allow_runtime_lora_updating=True
    )
    running = server_factory(config)
    response = post(
        running, "load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters["sql"])}
    )
    assert response.status_code == 400 and response.json()["error"]["code"] == "lora_disabled"


def test_lora_modules_on_the_command_line(server_model, adapters):
    json_form = json.dumps(
        {"name": "chat", "path": str(adapters["chat"]), "base_model_name": "base"}
    )
    flags = (
        "--enable-lora",
        "--max-lora-rank",
        "16",
        "--lora-modules",
        f"sql={adapters['sql']}",
        json_form,
    )
    with cli_server(server_model, *flags) as (_, base_url):
        cards = {c["id"]: c for c in httpx.get(f"{base_url}/v1/models").json()["data"]}
        assert cards["sql"]["parent"] == str(server_model) and cards["chat"]["parent"] == "base"
    command = [sys.executable, "-m", "octavo.cli", "serve", str(server_model)]
    refused = subprocess.run(
        [*command, "--lora-modules", f"sql={adapters['sql']}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0 and "--enable-lora" in refused.stderr


def test_an_adapter_with_a_request_in_flight_is_not_unloaded(lora_server, adapters):
    """A request of ``sql`` held open in the server's event loop (its first output read, the
    rest not): the unload is refused until it ends, then goes through."""
    import asyncio

    from octavo.inputs import RequestOptions

    engine = lora_server.async_engine
    lora = lora_server.engine.lora_registry.get("sql")
    params = SamplingParams(temperature=0.0, max_tokens=5)
    request = lora_server.engine.input_processor.process(
        "held", {"prompt_token_ids": PROMPT}, params, RequestOptions(lora_request=lora)
    )

    async def first_output():
        outputs = engine.generate(request)
        await outputs.__anext__()
        return outputs

    def in_loop(coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, engine._loop).result(timeout=30)

    outputs = in_loop(first_output())
    busy = post(lora_server, "unload_lora_adapter", {"lora_name": "sql"})
    assert busy.status_code == 400, busy.text
    assert busy.json()["error"]["code"] == "lora_in_use"
    assert busy.json()["error"]["param"] == "lora_name"
    in_loop(outputs.aclose())
    assert post(lora_server, "unload_lora_adapter", {"lora_name": "sql"}).status_code == 200
    again = post(
        lora_server, "load_lora_adapter", {"lora_name": "sql", "lora_path": str(adapters["sql"])}
    )
    assert again.status_code == 200
