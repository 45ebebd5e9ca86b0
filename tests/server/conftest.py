"""Fixtures for server tests: a tiny model with a chat template, real servers on free ports, the
offline LLM as the oracle, and helpers to read /metrics."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from octavo import LLM  # noqa: E402
from octavo.config import EngineArgs  # noqa: E402
from octavo.engine.async_engine import AsyncEngine  # noqa: E402
from octavo.engine.llm_engine import LLMEngine  # noqa: E402
from octavo.entrypoints.openai.api_server import build_app  # noqa: E402
from octavo.entrypoints.openai.serving_common import ServerConfig  # noqa: E402
from octavo.metrics import EngineMetrics  # noqa: E402
from octavo.testing.tiny_models import TinyModelSpec, write_tiny_model  # noqa: E402

TINY = TinyModelSpec(
    "LlamaForCausalLM",
    hidden_size=64,
    num_hidden_layers=2,
    vocab_size=512,
    max_position_embeddings=256,
    seed=11,
)
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
from server_constants import ENGINE_DEFAULTS, MODEL_NAME  # noqa: E402  (a unique module name: every test folder has a conftest)


@pytest.fixture(autouse=True, scope="session")
def _tiny_shapes_on_one_thread(one_torch_thread):
    """Every test here runs on one torch thread (``one_torch_thread`` in tests/conftest.py)."""


@pytest.fixture(scope="session")
def server_model(tmp_path_factory) -> Path:
    """A tiny random Llama whose tokenizer has a chat template."""
    folder = write_tiny_model(tmp_path_factory.mktemp("server_tiny") / "llama", TINY)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return folder


@dataclasses.dataclass
class RunningServer:
    """A real uvicorn server on 127.0.0.1 in a background thread."""

    base_url: str
    engine: LLMEngine
    async_engine: AsyncEngine
    server: Any
    thread: threading.Thread

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"

    def client(self, api_key: str = "none", **kwargs) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.api_url, api_key=api_key, max_retries=0, **kwargs)

    def async_client(self, api_key: str = "none", **kwargs) -> "openai.AsyncOpenAI":
        return openai.AsyncOpenAI(base_url=self.api_url, api_key=api_key, max_retries=0, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Every sample on /metrics, keyed ``name{label="value"}`` (labels sorted)."""
        text = httpx.get(f"{self.base_url}/metrics").text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return samples

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Wait until the engine has no request and every KV block is back in the pool."""
        kv = self.engine.core.kv_cache_manager
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (
                not self.engine.has_unfinished_requests()
                and kv.num_free_blocks == kv.block_pool.num_blocks
            ):
                return
            time.sleep(0.02)
        raise AssertionError(
            f"engine not idle after {timeout} s: "
            f"{kv.num_free_blocks}/{kv.block_pool.num_blocks} blocks free"
        )

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(
    model: Path,
    config: Optional[ServerConfig] = None,
    metrics: Optional[EngineMetrics] = None,
    **engine_args,
) -> RunningServer:
    """Build an engine on ``model`` and serve it on a free port; returns once it accepts
    requests."""
    import uvicorn

    engine = LLMEngine(EngineArgs(model=str(model), **{**ENGINE_DEFAULTS, **engine_args}))
    async_engine = AsyncEngine(engine, metrics)
    config = config or ServerConfig(served_model_name=MODEL_NAME, log_requests=False)
    app = build_app(async_engine, config)
    # IPPROTO_TCP, so asyncio sets TCP_NODELAY: with Nagle on, each kept-alive response waits ~40 ms
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    return RunningServer(f"http://127.0.0.1:{port}", engine, async_engine, server, thread)


@pytest.fixture
def server_factory(server_model) -> Callable[..., RunningServer]:
    """Start servers with their own settings; all are stopped after the test."""
    servers = []

    def factory(config: Optional[ServerConfig] = None, **engine_args) -> RunningServer:
        servers.append(start_server(server_model, config, **engine_args))
        return servers[-1]

    yield factory
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def module_server_factory() -> Callable[..., RunningServer]:
    """Start servers on a model of the test's choosing; all are stopped after the module."""
    servers = []

    def factory(model: Path, config: Optional[ServerConfig] = None, **engine_args):
        servers.append(start_server(model, config, **engine_args))
        return servers[-1]

    yield factory
    for running in servers:
        running.stop()


@pytest.fixture(scope="module")
def server(server_model) -> RunningServer:
    """One server per test module, with the default settings."""
    running = start_server(server_model)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def offline(server_model) -> LLM:
    """The offline LLM on the same model and engine settings: the oracle for server outputs."""
    return LLM(str(server_model), **ENGINE_DEFAULTS)


@pytest.fixture(scope="module")
def chat_ids(offline) -> Callable[[list[dict]], list[int]]:
    """The prompt ids the model's chat template gives a conversation."""

    def render(messages: list[dict]) -> list[int]:
        rendered = offline.get_tokenizer().apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)

    return render
