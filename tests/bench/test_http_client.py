"""The benchmark's HTTP client against an in-process asyncio server that speaks HTTP/1.1 with
keep-alive: connection reuse, SSE splitting across reads, error statuses, timeouts."""

from __future__ import annotations

import asyncio
import json

import pytest

from octavo.bench.http_client import HTTPClient, HTTPError, _sse_data

pytest.importorskip("httptools")


async def _serve(handler):
    """Start a server that answers every request on a connection with ``handler(line, body)``
    -> (status, chunks, delay_s); returns (server, base url, list of request lines, connections)."""
    lines, connections = [], [0]

    async def handle(reader, writer):
        connections[0] += 1
        while True:
            try:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            request_line, *rest = head.rstrip("\r\n").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, v in (r.split(":", 1) for r in rest)}
            body = await reader.readexactly(int(headers.get("content-length", 0)))
            lines.append(request_line)
            status, chunks, delay = handler(request_line, body)
            writer.write(b"HTTP/1.1 %d X\r\nTransfer-Encoding: chunked\r\n\r\n" % status)
            for chunk in chunks:
                await asyncio.sleep(delay)
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", lines, connections


def test_streams_events_split_anywhere_and_reuses_one_connection():
    events = [b"data: " + json.dumps({"i": i}).encode() + b"\n\n" for i in range(5)]
    stream = b"".join(events) + b"data: [DONE]\n\n"
    # The stream cut into pieces that split events and the blank line between them.
    pieces = [stream[i : i + 7] for i in range(0, len(stream), 7)]

    async def run():
        server, url, lines, connections = await _serve(lambda line, body: (200, pieces, 0.001))
        async with server, HTTPClient(url + "/prefix") as client:
            got = []
            for _ in range(3):
                got.append([d async for _, d in client.post_stream("/v1/x", b"{}")])
            status, models = await client.get("/v1/models")
        return got, status, models, lines, connections[0]

    got, status, models, lines, connections = asyncio.run(run())
    expected = [json.dumps({"i": i}).encode() for i in range(5)] + [b"[DONE]"]
    assert got == [expected] * 3
    assert status == 200 and models == stream
    assert lines == ["POST /prefix/v1/x HTTP/1.1"] * 3 + ["GET /prefix/v1/models HTTP/1.1"]
    assert connections == 1


def test_an_error_status_raises_with_the_body():
    async def run():
        server, url, _, _ = await _serve(lambda line, body: (400, [b'{"error": "bad"}'], 0))
        async with server, HTTPClient(url) as client:
            with pytest.raises(HTTPError, match='HTTP 400.*"error": "bad"'):
                async for _ in client.post_stream("/v1/completions", b"{}"):
                    pass
            assert await client.get("/v1/models") == (400, b'{"error": "bad"}')

    asyncio.run(run())


def test_a_response_slower_than_the_timeout_fails():
    # The server sends the head and then holds the body until the client has given up: the
    # response cannot complete before the timeout, however fast or slow the machine.
    async def run():
        release = asyncio.Event()

        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            await release.wait()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server, HTTPClient(url, timeout=0.2) as client:
            with pytest.raises(HTTPError, match="no complete response in 0.2 s"):
                async for _ in client.post_stream("/v1/completions", b"{}"):
                    pass
            release.set()

    asyncio.run(run())


def test_sse_data_keeps_an_incomplete_event_for_the_next_read():
    stream = b"data: 1\r\n\r\nevent: x\ndata: 2\n\n: comment\n\ndata: [DONE]\n\n"
    for cut in range(len(stream) + 1):  # every split of the stream into two reads
        first, rest = _sse_data(stream[:cut])
        second, rest = _sse_data(rest + stream[cut:])
        assert first + second == [b"1", b"2", b"[DONE]"] and rest == b""


def test_a_refused_connection_and_a_bad_url_say_what_is_wrong():
    async def run():
        async with HTTPClient("http://127.0.0.1:1") as client:
            with pytest.raises(HTTPError, match="cannot connect to 127.0.0.1:1"):
                await client.get("/v1/models")

    asyncio.run(run())
    with pytest.raises(ValueError, match="give http://host:port"):
        HTTPClient("127.0.0.1:8000")
