"""``octavo bench serve``'s connections against an in-process stand-in for llama-server, which
offers keep-alive but closes the connection after every response."""

from __future__ import annotations

import asyncio
import json

from octavo.bench.serve import _workload, run_sweep
from octavo.cli import build_parser


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _answer(reader, writer, seen: list[dict]) -> None:
    """Read one request, stream its answer (chunked, ``Connection: keep-alive``), then close."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    request_line, *lines = head.rstrip("\r\n").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    body = await reader.readexactly(int(headers.get("content-length", 0)))
    seen.append({"line": request_line, "connection": headers.get("connection")})
    if request_line.startswith("GET /metrics"):  # llama-server has none unless asked
        writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()
        return
    if request_line.startswith("GET /v1/models"):
        events = [json.dumps({"data": [{"id": "fake"}]}).encode()]
        kind = b"application/json"
    else:
        n = json.loads(body)["max_tokens"]
        events = [b"data: " + json.dumps({"choices": [{"text": "x"}]}).encode() + b"\n\n"] * n
        usage = {"choices": [], "usage": {"completion_tokens": n}}
        events += [b"data: " + json.dumps(usage).encode() + b"\n\n", b"data: [DONE]\n\n"]
        kind = b"text/event-stream"
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: " + kind + b"\r\nTransfer-Encoding: chunked\r\n"
        b"Keep-Alive: timeout=5, max=100\r\nConnection: keep-alive\r\n\r\n"
    )
    for event in events:
        writer.write(_chunk(event))
        await writer.drain()
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    writer.close()  # what llama-server does, although it said keep-alive


async def _sweep_against_fake_server(extra: list[str]) -> tuple[list[dict], list[dict], int]:
    seen, connections = [], [0]

    async def handle(reader, writer):
        connections[0] += 1
        await _answer(reader, writer, seen)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    argv = ["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--vocab-size", "64"]
    argv += ["--max-concurrency", "1,2", "--num-prompts", "4", "--input-len", "4", "4"]
    argv += ["--output-len", "3", "3", "--disable-tqdm", *extra]
    args = build_parser().parse_args(argv)
    async with server:
        runs = await run_sweep(args, _workload(args))
    return runs, seen, connections[0]


def test_no_keep_alive_opens_one_connection_per_request():
    runs, seen, connections = asyncio.run(_sweep_against_fake_server(["--no-keep-alive"]))
    assert [(r["completed"], r["failed"], r["output_tokens"]) for r in runs] == [(4, 0, 12)] * 2
    # /v1/models, one warm-up, /metrics before and after each level (for the acceptance of
    # speculative decoding; 404 here) and 4 requests per level: each on a connection of its own.
    assert len(seen) == connections == 1 + 1 + 4 + 8
    assert all("spec_num_drafts" not in r for r in runs)
    assert {s["connection"] for s in seen} == {"close"}


def test_keep_alive_is_the_default():
    args = build_parser().parse_args(["bench", "serve"])
    assert args.no_keep_alive is False


def test_keep_alive_survives_a_server_that_closes_after_each_response():
    # Each pooled connection is found closed on its first read and the request is sent again
    # on a new one: nothing fails, every request reaches the server once.
    runs, seen, connections = asyncio.run(_sweep_against_fake_server([]))
    assert [(r["completed"], r["failed"], r["output_tokens"]) for r in runs] == [(4, 0, 12)] * 2
    assert len(seen) == connections == 1 + 1 + 4 + 8
    assert {s["connection"] for s in seen} == {"keep-alive"}
    assert all(r["client_cpu_ms_per_output_token"] > 0 for r in runs)
