"""The ``octavo bench`` subcommands: ``throughput``, ``serve``, ``latency`` and ``startup``."""

from __future__ import annotations

import argparse
import importlib


def _runner(module: str):
    def run(args: argparse.Namespace) -> int:
        return importlib.import_module(f"octavo.bench.{module}").main(args)

    return run


def add_bench_parser(commands) -> argparse.ArgumentParser:
    """Add ``bench`` and its subcommands to the ``octavo`` subparsers ``commands``."""
    from octavo.bench.latency import add_latency_args
    from octavo.bench.serve import add_serve_bench_args
    from octavo.bench.startup import add_startup_args
    from octavo.bench.throughput import add_throughput_args

    bench = commands.add_parser("bench", help="benchmark throughput, serving, latency or start-up")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    for name, add_args, help_text in (
        ("throughput", add_throughput_args, "offline, in-process throughput of LLM.generate"),
        (
            "serve",
            add_serve_bench_args,
            "streaming load against an OpenAI-compatible server (octavo, vLLM, ...)",
        ),
        ("latency", add_latency_args, "one batch end to end, with per-step timing"),
        ("startup", add_startup_args, "seconds from starting octavo serve to /health/ready"),
    ):
        add_args(kinds.add_parser(name, help=help_text)).set_defaults(run=_runner(name))
    return bench
