"""How much the HTTP server costs over the offline engine on the same workload.

The offline ``LLM.generate`` run is the ceiling for any server design (thread or process): the
same engine with no HTTP, no SSE and no hand-over between threads. The server run starts
``octavo serve`` in a subprocess and drives it with concurrent streaming clients (raw SSE over
httpx, to keep the client's own CPU use small) from this process.

    .venv/bin/python benchmarks/serve_overhead.py --num-requests 64 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time

# ruff: noqa: I001 - octavo comes before torch: it sets OMP_WAIT_POLICY before OpenMP loads
import octavo  # noqa: F401
import httpx2 as httpx
import psutil
import torch

from octavo import LLM, SamplingParams
from octavo.testing.tiny_models import TinyModelSpec, write_tiny_model

PROMPT = "once upon a time there was a little girl named lily"


def offline_run(
    model: str, num_requests: int, max_tokens: int, engine_flags: dict
) -> tuple[float, float]:
    """(tokens/s, CPU seconds per 1000 tokens) of the offline engine."""
    llm = LLM(model, **engine_flags)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate([PROMPT], params, use_tqdm=False)  # warm-up
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate([PROMPT] * num_requests, params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return num_tokens / elapsed, 1000 * cpu / num_tokens


async def _drive(
    base_url: str, num_requests: int, max_tokens: int, server: psutil.Process
) -> tuple[float, float]:
    """(tokens/s, server CPU seconds per 1000 tokens) over ``num_requests`` concurrent streams."""
    body = {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    limits = httpx.Limits(max_connections=num_requests + 1)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:

        async def one() -> int:
            num_chunks = 0
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    num_chunks += line.startswith("data: {")
            return num_chunks

        await one()  # warm-up
        start, cpu_start = time.perf_counter(), sum(server.cpu_times()[:2])
        chunks = await asyncio.gather(*(one() for _ in range(num_requests)))
        elapsed, cpu = time.perf_counter() - start, sum(server.cpu_times()[:2]) - cpu_start
    assert min(chunks) > 0, "every stream should have produced text"
    num_tokens = num_requests * max_tokens  # ignore_eos: every request runs to max_tokens
    return num_tokens / elapsed, 1000 * cpu / num_tokens


def server_run(
    model: str, num_requests: int, max_tokens: int, engine_flags: dict
) -> tuple[float, float]:
    """(tokens/s, server CPU seconds per 1000 tokens) of ``octavo serve`` in a subprocess."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine_flags.items()]
    command = [
        sys.executable,
        "-m",
        "octavo.cli",
        "serve",
        model,
        "--port",
        str(port),
        "--served-model-name",
        "bench",
        "--disable-log-requests",
        "--uvicorn-log-level",
        "warning",
        *flags,
    ]
    process = subprocess.Popen(
        command, env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError("the server exited")
            try:
                if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        return asyncio.run(_drive(base_url, num_requests, max_tokens, psutil.Process(process.pid)))
    finally:
        process.terminate()
        process.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="model folder (default: a random 4-layer, 256-wide Llama)"
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in both runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        spec = TinyModelSpec(
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=2048,
            max_position_embeddings=512,
        )
        model = str(write_tiny_model(tempfile.mkdtemp(prefix="octavo-bench-") + "/model", spec))
    engine_flags = {"kv_cache_memory": "256MiB", "max_num_seqs": 128}
    offline, offline_cpu = offline_run(model, args.num_requests, args.max_tokens, engine_flags)
    served, served_cpu = server_run(model, args.num_requests, args.max_tokens, engine_flags)
    print(
        f"{args.num_requests} requests x {args.max_tokens} tokens, {args.threads} torch thread(s)"
    )
    print(
        f"offline LLM.generate: {offline:8.1f} tokens/s  {offline_cpu:6.3f} CPU s per 1000 tokens"
    )
    print(
        f"octavo serve (HTTP):  {served:8.1f} tokens/s  {served_cpu:6.3f} CPU s per 1000 tokens "
        "(server process)"
    )


if __name__ == "__main__":
    main()
