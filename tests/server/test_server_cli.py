"""``octavo serve``: its flags, the demo-model default, and graceful shutdown on SIGTERM."""

from __future__ import annotations

import json
import signal
import socket
import threading
from pathlib import Path

import httpx2 as httpx
import pytest
from cli_server import cli_server  # noqa: E402  (tests/server/cli_server.py)

from octavo.cli import build_parser
from octavo.config import EngineArgs
from octavo.entrypoints.openai import serve
from octavo.errors import ConfigError


def test_serve_flags_reach_engine_args_and_server():
    args = build_parser().parse_args(
        [
            "serve",
            "/models/m",
            "--max-num-seqs",
            "8",
            "--block-size",
            "32",
            "--no-enable-prefix-caching",
            "--max-num-batched-tokens",
            "1024",
            "--preemption-mode",
            "swap",
            "--scheduling-policy",
            "priority",
            "--api-key",
            "k",
            "--max-queue-len",
            "3",
            "--served-model-name",
            "m1",
            "--shutdown-timeout",
            "5",
            "--kv-cache-memory",
            "1GiB",
            "--disable-log-requests",
            "--uvicorn-log-level",
            "warning",
        ]
    )
    engine_args = EngineArgs.from_cli_args(args, model=args.model)
    assert (engine_args.model, engine_args.max_num_seqs, engine_args.block_size) == (
        "/models/m",
        8,
        32,
    )
    assert not engine_args.enable_prefix_caching and engine_args.max_num_batched_tokens == 1024
    assert (engine_args.preemption_mode, engine_args.scheduling_policy) == ("swap", "priority")
    assert engine_args.kv_cache_memory == 1 << 30 and engine_args.served_model_name == "m1"
    assert (args.api_key, args.max_queue_len, args.shutdown_timeout) == ("k", 3, 5.0)
    assert args.disable_log_requests and args.uvicorn_log_level == "warning"
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.model, defaults.host, defaults.port) == (None, "127.0.0.1", 8000)


def test_missing_demo_model_fails_with_a_clear_message(monkeypatch, tmp_path):
    monkeypatch.setattr(serve.importlib.resources, "files", lambda package: tmp_path)
    with pytest.raises(ConfigError, match="octavo serve /path/to/model"):
        serve.demo_model_path()
    (tmp_path / "data" / "demo-model").mkdir(parents=True)
    (tmp_path / "data" / "demo-model" / "config.json").write_text("{}")
    assert serve.demo_model_path() == tmp_path / "data" / "demo-model"


def test_a_port_in_use_is_refused_before_the_engine_starts(monkeypatch):
    """The server binds its port before building the engine (so nothing the engine starts, such
    as a tensor-parallel rendezvous on a free port, can take it): a port in use is a ConfigError
    naming it, and no engine is built."""
    built = []
    monkeypatch.setattr("octavo.engine.llm_engine.LLMEngine.__init__", built.append)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = build_parser().parse_args(["serve", "--port", str(port)])
        with pytest.raises(ConfigError, match=f"cannot serve on 127.0.0.1:{port}.*--port"):
            serve.run_serve(args)
    assert built == []
    with serve.listening_socket("127.0.0.1", port) as sock:  # free again: bound, not listening
        assert sock.getsockname()[1] == port


@pytest.mark.slow
def test_sigterm_lets_10_streams_finish_then_exits_0(server_model: Path):
    with cli_server(server_model, "--shutdown-timeout", "60") as (process, base_url):
        body = {
            "prompt": "once upon a time",
            "max_tokens": 150,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        started = threading.Barrier(11)
        results: list = [None] * 10

        def client(i: int) -> None:
            with (
                httpx.Client(base_url=base_url, timeout=120) as http,
                http.stream("POST", "/v1/completions", json=body) as stream,
            ):
                lines = stream.iter_lines()
                chunks = [next(line for line in lines if line)]
                started.wait()
                chunks += [line for line in lines if line]
            results[i] = chunks

        threads = [threading.Thread(target=client, args=(i,)) for i in range(10)]
        for thread in threads:
            thread.start()
        started.wait(timeout=120)
        process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=120)
        assert process.wait(timeout=120) == 0
    for chunks in results:
        assert chunks is not None and chunks[-1] == "data: [DONE]"
        assert json.loads(chunks[-2].removeprefix("data: "))["usage"]["completion_tokens"] == 150
