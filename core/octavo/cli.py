"""The ``octavo`` command line: ``octavo env``, ``octavo serve``, ``octavo bench``,
``octavo train-draft``."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from octavo.errors import PlatformError


def _env(args: argparse.Namespace) -> int:
    from octavo.platform.env_report import render_env_report

    print(render_env_report(device=args.device))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from octavo.entrypoints.openai.serve import run_serve

    return run_serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="octavo", description="LLM inference and serving engine")
    commands = parser.add_subparsers(dest="command", required=True)
    env = commands.add_parser(
        "env", help="print discovered plugins, what they detected, and the platform chosen"
    )
    env.add_argument("--device", default=None, help="platform to force, as at serve time")
    env.set_defaults(run=_env)
    from octavo.entrypoints.openai.serve import add_serve_args

    serve = commands.add_parser("serve", help="serve a model over the OpenAI-compatible HTTP API")
    add_serve_args(serve).set_defaults(run=_serve)
    from octavo.bench.cli import add_bench_parser

    add_bench_parser(commands)
    from octavo.train_draft.cli import add_train_draft_parser

    add_train_draft_parser(commands)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    from octavo.entrypoints.start_up import collection_paused

    with collection_paused():  # the subcommands' imports: modules live as long as the process
        args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (PlatformError, ValueError) as exc:
        print(f"octavo: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
