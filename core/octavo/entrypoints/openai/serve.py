"""``octavo serve [MODEL]``: its flags, the bundled demo model, and running uvicorn."""

from __future__ import annotations

import argparse
import importlib.resources
import logging
import os
import signal
import socket
from pathlib import Path
from typing import Optional

from octavo.config import EngineArgs
from octavo.errors import ConfigError

DEMO_MODEL_NAME = "octavo-demo"
# The demo model's KV cache unless --kv-cache-memory says otherwise: ample for a 4M-parameter model
# with a 512-token context, where --gpu-memory-utilization of a CPU's RAM would take most of it.
DEMO_KV_CACHE_MEMORY = "1GiB"
API_KEY_ENV = "OCTAVO_API_KEY"
DEMO_TOOL_CALL_PARSER = "hermes"


def demo_model_path() -> Path:
    """The bundled demo model folder (package data), or ConfigError when it is not installed."""
    folder = Path(str(importlib.resources.files("octavo").joinpath("data", "demo-model")))
    if not (folder / "config.json").is_file():
        raise ConfigError(
            "no MODEL given and the bundled demo model is not installed "
            f"({folder} has no config.json); "
            "pass a local HuggingFace model folder: octavo serve /path/to/model"
        )
    return folder


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The server's flags plus every engine flag of EngineArgs."""
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="local HuggingFace model folder (default: the bundled demo model)",
    )
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1 routes (also ${API_KEY_ENV})",
    )
    server.add_argument(
        "--max-queue-len",
        type=int,
        default=None,
        help="requests that may wait beyond --max-num-seqs before new ones get 503",
    )
    server.add_argument(
        "--disable-log-requests", action="store_true", help="do not log each request"
    )
    server.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds to let in-flight requests finish after SIGTERM",
    )
    server.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template (file or inline) for models without one",
    )
    server.add_argument(
        "--ready-timeout",
        type=float,
        default=10.0,
        help="seconds /health/ready waits for its one-token generation",
    )
    server.add_argument(
        "--metrics-naming",
        default="octavo",
        choices=("octavo", "vllm"),  # octavo.metrics.METRIC_NAMINGS (not imported for --help)
        help="the names /metrics exposes: octavo's (octavo_*) or vLLM's (vllm:*, with its "
        "model_name and engine labels, for dashboards, autoscalers and routers made for vLLM)",
    )
    server.add_argument(
        "--tool-call-parser",
        default=None,
        help="read tool calls in this format (a name from the octavo_tool_parsers hook: "
        "hermes is built in; default for the demo model: hermes)",
    )
    server.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let tool_choice "auto" (the default with tools) through: free text, and calls '
        "where the model opens one (needs --tool-call-parser; on for the demo model)",
    )
    add_lora_modules_arg(server)
    EngineArgs.add_cli_args(parser)
    return parser


def add_lora_modules_arg(server) -> None:
    """``--lora-modules``: the adapters served from the start (``--enable-lora`` and the slots'
    sizes are engine flags, ``octavo.config.add_lora_args``)."""
    server.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) to serve from the start, each as NAME=PATH or as "
        'JSON \'{"name": ..., "path": ..., "base_model_name": ...}\'; a request\'s "model" '
        "names one (needs --enable-lora)",
    )


def lora_module(text: str) -> dict:
    """One ``--lora-modules`` value: ``NAME=PATH`` or vLLM's JSON object."""
    if text.lstrip().startswith("{"):
        from octavo.config import json_object

        module = json_object(text)
        unknown = set(module) - {"name", "path", "base_model_name"}
        if (
            unknown
            or not isinstance(module.get("name"), str)
            or not isinstance(module.get("path"), str)
        ):
            raise argparse.ArgumentTypeError(
                f"--lora-modules JSON needs string 'name' and 'path' (and optionally "
                f"'base_model_name'); got {text!r}"
            )
        return module
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules takes NAME=PATH; got {text!r}")
    return {"name": name, "path": path}


def register_lora_modules(engine, modules: Optional[list[dict]], served_model_name: str) -> None:
    """Serve ``--lora-modules``' adapters (each checked against the base model now)."""
    if not modules:
        return
    if not engine.lora_registry.enabled:
        raise ConfigError("--lora-modules needs --enable-lora")
    for module in modules:
        if module["name"] == served_model_name:
            raise ConfigError(
                f"--lora-modules: {module['name']!r} is the base model's name; name it otherwise"
            )
        engine.lora_registry.add(module["name"], module["path"], module.get("base_model_name"))


def _chat_template(value: Optional[str]) -> Optional[str]:
    if value is None:
        return None
    path = Path(value)
    return path.read_text() if path.is_file() else value


def run_serve(args: argparse.Namespace) -> int:
    """Load the engine, then serve until SIGTERM/SIGINT; returns the exit status."""
    from octavo.entrypoints.start_up import collection_paused

    if args.max_queue_len is not None and args.max_queue_len < 0:
        raise ConfigError(f"--max-queue-len must be >= 0; got {args.max_queue_len}")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    overrides = {"model": args.model}
    tool_call_parser, auto_tool_choice = args.tool_call_parser, bool(args.enable_auto_tool_choice)
    if args.model is None:
        overrides["model"] = str(demo_model_path())
        if args.kv_cache_memory is None:
            overrides["kv_cache_memory"] = DEMO_KV_CACHE_MEMORY
        if tool_call_parser is None:  # its chat template writes calls the Hermes way
            tool_call_parser = DEMO_TOOL_CALL_PARSER
            auto_tool_choice = True
    model = overrides["model"]
    default_name = args.model if args.model is not None else DEMO_MODEL_NAME
    engine_args = EngineArgs.from_cli_args(args, **overrides)
    if engine_args.parallel_config.node_rank > 0:
        from octavo.distributed.headless import run_headless

        return run_headless(engine_args)  # workers for node 0's engine, no server
    listening = listening_socket(args.host, args.port)
    # uvicorn restores this handler after its graceful shutdown and re-raises the signal: exit 0.
    signal.signal(signal.SIGTERM, _exit_zero)
    try:
        with collection_paused():  # the server's modules and engine live as long as it does
            import uvicorn

            from octavo.engine.async_engine import AsyncEngine
            from octavo.engine.llm_engine import LLMEngine
            from octavo.entrypoints.openai.api_server import build_app
            from octavo.entrypoints.openai.serving_common import ServerConfig
            from octavo.entrypoints.openai.serving_lora import runtime_updating_allowed
            from octavo.metrics import EngineMetrics

            config = ServerConfig(
                served_model_name=args.served_model_name or default_name,
                model_path=model,
                api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                max_queue_len=args.max_queue_len,
                log_requests=not args.disable_log_requests,
                chat_template=_chat_template(args.chat_template),
                ready_timeout=args.ready_timeout,
                tool_call_parser=tool_call_parser,
                enable_auto_tool_choice=auto_tool_choice,
                allow_runtime_lora_updating=runtime_updating_allowed(os.environ),
            )
            metrics = EngineMetrics(naming=args.metrics_naming, model_name=config.served_model_name)
            engine = LLMEngine(engine_args)
            register_lora_modules(engine, args.lora_modules, config.served_model_name)
            app = build_app(AsyncEngine(engine, metrics), config)
    except BaseException:
        listening.close()
        raise
    uvicorn_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
        access_log=not args.disable_log_requests,
    )
    uvicorn.Server(uvicorn_config).run(sockets=[listening])
    return 0


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the engine starts: nothing the engine does takes the
    port first (a tensor-parallel rendezvous picks any free port), and a port in use is refused
    before the model loads. uvicorn listens on it once the engine is up."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot serve on {host}:{port}: {exc.strerror or exc}; pass a free --port "
            "(or --host an address of this machine)"
        ) from None
    return sock  # not inheritable: spawned tensor-parallel workers do not hold it


def _exit_zero(signum: int, frame: object) -> None:
    raise SystemExit(0)
