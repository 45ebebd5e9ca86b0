"""`octavo serve` as a child process on a free loopback port, for the tests that need the real
command line (its flags, its signal handling)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx2 as httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def cli_server(
    model: Path, *flags: str, timeout: float = 180.0
) -> Iterator[tuple[subprocess.Popen, str]]:
    """``(process, base_url)`` once /health answers 200; the process is killed after if it is
    still running (a test may stop it itself, with SIGTERM, and check how it exits)."""
    port = free_port()
    command = [
        sys.executable, "-m", "octavo.cli", "serve", str(model), "--port", str(port),
        "--kv-cache-memory", "8MiB", "--disable-log-requests", "--uvicorn-log-level", "warning",
        *flags,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert process.poll() is None, process.stdout.read().decode()
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield process, base_url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=60)
