"""``octavo bench startup``: seconds from starting ``octavo serve`` to ``/health/ready`` answering
200."""

from __future__ import annotations

import argparse
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from octavo.bench.report import print_table, write_json


def import_httpx():
    """httpx, imported only when a benchmark runs (it is ``httpx2`` in some environments)."""
    try:
        import httpx2 as httpx
    except ImportError:  # pragma: no cover - the upstream name
        import httpx
    return httpx


def add_startup_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``MODEL``, repetitions, a time limit, and extra ``octavo serve`` flags as one
    ``--serve-args`` string."""
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="model folder for octavo serve (default: the demo model)",
    )
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="give up on a start after this many seconds"
    )
    parser.add_argument("--output-json", type=Path, default=None)
    parser.add_argument(
        "--serve-args", default="", help="extra octavo serve flags, e.g. '--kv-cache-memory 1GiB'"
    )
    return parser


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(
    model: Optional[str], serve_args: Sequence[str] = (), timeout: float = 300.0
) -> tuple[subprocess.Popen, str, float]:
    """Start ``octavo serve`` on a free port; return (process, base URL, seconds until
    /health/ready was 200).

    The caller owns the process and must terminate it. Raises ValueError when it exits or times out.
    """
    httpx = import_httpx()
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "octavo.cli",
        "serve",
        *([model] if model else []),
        "--port",
        str(port),
        "--disable-log-requests",
        "--uvicorn-log-level",
        "warning",
        *serve_args,
    ]
    base_url = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    log = (
        tempfile.TemporaryFile()
    )  # a file, not a pipe: a chatty server must never block on a full pipe
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    while True:
        if process.poll() is not None:
            log.seek(0)
            raise ValueError(
                f"octavo serve exited with {process.returncode} before it was ready "
                f"(check MODEL and --serve-args): {log.read().decode(errors='replace')[-2000:]}"
            )
        if time.perf_counter() - start > timeout:
            stop_server(process)
            raise ValueError(f"octavo serve was not ready after {timeout} s; raise --timeout")
        try:
            if httpx.get(f"{base_url}/health/ready", timeout=timeout).status_code == 200:
                return process, base_url, time.perf_counter() - start
        except httpx.TransportError:
            pass
        time.sleep(0.05)


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def main(args: argparse.Namespace) -> int:
    """Start and stop the server ``--num-iters`` times; print the start-up seconds."""
    if args.num_iters < 1:
        raise ValueError(f"--num-iters must be >= 1; got {args.num_iters}")
    serve_args = shlex.split(args.serve_args)
    import psutil

    times, rss = [], []
    for _ in range(args.num_iters):
        process, _, seconds = start_server(args.model, serve_args, args.timeout)
        rss.append(psutil.Process(process.pid).memory_info().rss / 2**20)
        stop_server(process)
        times.append(seconds)
    result = {
        "benchmark": "startup",
        "model": args.model or "demo",
        "num_iters": args.num_iters,
        "startup_s": times,
        "startup_mean_s": float(np.mean(times)),
        "startup_min_s": float(np.min(times)),
        "ready_rss_mib": float(np.max(rss)),
    }
    print_table(
        [result], ["model", "num_iters", "startup_mean_s", "startup_min_s", "ready_rss_mib"]
    )
    write_json(args.output_json, result)
    return 0
