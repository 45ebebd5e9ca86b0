"""The HTTP/1.1 client of ``octavo bench serve``: asyncio streams, httptools' C parser, pooled
keep-alive connections.

On a small host the benchmark client shares the cores with the server it measures, and what
the client spends on each streamed token is taken from the server. Driving the tiny model at
concurrency 32 on 2 cores (BENCHMARKS.md), httpx's streaming cost 0.19-0.25 CPU ms per token
(mostly httpcore's pure-Python h11 parsing and anyio); this client, where httptools (uvicorn's
parser) reads the status, the headers and the chunked framing, costs 0.05-0.06.

A connection goes back to the pool after a complete response the server lets it keep. A pooled
connection that the server closed in the meantime (llama-server closes after every streamed
response although it answers keep-alive) fails on its first read; the request is then sent
once more on a new connection.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from typing import AsyncIterator, Optional
from urllib.parse import urlsplit


class HTTPError(Exception):
    """A request that failed: the connection broke, timed out, or the status was not 200."""


def _sse_data(pending: bytes) -> tuple[list[bytes], bytes]:
    """The ``data:`` payloads of the complete server-sent events in ``pending``, and the bytes
    after the last complete event."""
    if b"\r" in pending:
        pending = pending.replace(b"\r\n", b"\n")
    *events, rest = pending.split(b"\n\n")
    payloads = [
        line[5:].strip()
        for event in events
        for line in event.split(b"\n")
        if line.startswith(b"data:")
    ]
    return payloads, rest


class _Response:
    """httptools' callbacks for one response: its status, its body as it arrives, its end."""

    __slots__ = ("parser", "status", "body", "complete", "keep_alive")

    def __init__(self, httptools) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.body = bytearray()
        self.complete = False
        self.keep_alive = False

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, data: bytes) -> None:
        self.body += data

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()  # reads False once the parser resets


class _Connection:
    __slots__ = ("reader", "writer", "reused")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer, self.reused = reader, writer, False

    def close(self) -> None:
        self.writer.close()


class HTTPClient:
    """Requests to one server (``base_url``: ``http[s]://host[:port][/prefix]``)."""

    def __init__(
        self,
        base_url: str,
        *,
        headers: Optional[dict[str, str]] = None,
        keep_alive: bool = True,
        timeout: float = 600.0,
    ) -> None:
        try:
            import httptools
        except ImportError:  # pragma: no cover - installed with octavo[serve]
            raise ImportError(
                "octavo bench serve needs httptools: pip install 'octavo[serve]' "
                "(or pip install httptools)"
            ) from None
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"--base-url {base_url!r}: give http://host:port or https://host:port")
        self._httptools = httptools
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if url.scheme == "https" else None
        self.prefix = url.path.rstrip("/")
        self.keep_alive = keep_alive
        self.timeout = timeout
        extra = {"Connection": "keep-alive" if keep_alive else "close", **(headers or {})}
        self._head_lines = f"Host: {url.netloc}\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in extra.items()
        )
        self._pool: list[_Connection] = []

    async def __aenter__(self) -> "HTTPClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        while self._pool:
            self._pool.pop().close()

    async def get(self, path: str) -> tuple[int, bytes]:
        """(status, body) of ``GET path``."""
        return await self._whole("GET", path, b"")

    async def post_stream(self, path: str, body: bytes) -> AsyncIterator[tuple[float, bytes]]:
        """POST ``body`` (JSON) and yield ``(arrival time, data)`` for every server-sent event's
        ``data:`` line, the time (``time.perf_counter``) taken when the read that brought it
        returned. Raises HTTPError when the status is not 200 or the stream breaks."""
        async for arrival, data in self._exchange("POST", path, body, sse=True):
            yield arrival, data

    async def _whole(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        status, whole = 0, bytearray()
        async for status, data in self._exchange(method, path, body, sse=False):
            whole += data
        return status, bytes(whole)

    async def _exchange(self, method: str, path: str, body: bytes, *, sse: bool):
        """Send one request (again on a new connection when a pooled one turns out closed).
        With ``sse``, yield ``(arrival time, data)`` per event's ``data:`` line and raise unless
        the status is 200; without, yield ``(status, body bytes)`` as they arrive."""
        head = (
            f"{method} {self.prefix}{path} HTTP/1.1\r\n{self._head_lines}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        loop = asyncio.get_running_loop()
        for attempt in (0, 1):
            connection = await self._connection(pooled=attempt == 0)
            connection.writer.write(head + body)
            response = _Response(self._httptools)
            timed_out = []

            def expire(connection=connection, timed_out=timed_out) -> None:
                timed_out.append(True)
                connection.writer.transport.abort()

            timer = loop.call_later(self.timeout, expire)
            received, pending = False, b""
            try:
                while not response.complete:
                    error: Optional[BaseException] = None
                    try:
                        data = await connection.reader.read(65536)
                    except (ConnectionError, OSError) as exc:
                        data, error = b"", exc
                    arrival = time.perf_counter()
                    if not data:
                        if connection.reused and not received and not timed_out and attempt == 0:
                            break  # the server closed it while pooled: send on a new connection
                        raise HTTPError(
                            f"no complete response in {self.timeout:g} s"
                            if timed_out
                            else f"the server closed the connection mid-response ({error or 'EOF'})"
                        )
                    received = True
                    try:
                        response.parser.feed_data(data)
                    except self._httptools.HttpParserError as exc:
                        raise HTTPError(f"malformed HTTP response: {exc}") from None
                    if not response.body or (sse and response.status != 200):
                        continue  # an error's body stays whole for the message below
                    if not sse:
                        chunk = bytes(response.body)
                        response.body.clear()
                        yield response.status, chunk
                        continue
                    payloads, pending = _sse_data(pending + response.body)
                    response.body.clear()
                    for payload in payloads:
                        yield arrival, payload
            finally:
                timer.cancel()
                if not response.complete:  # broken, or the consumer left mid-response
                    connection.close()
            if not response.complete:
                continue
            if self.keep_alive and response.keep_alive:
                connection.reused = True
                self._pool.append(connection)
            else:
                connection.close()
            if sse and response.status != 200:
                raise HTTPError(f"HTTP {response.status}: {bytes(response.body)[:200]!r}")
            if not sse:
                yield response.status, b""  # the status, also for a response without a body
            return

    async def _connection(self, pooled: bool) -> _Connection:
        if pooled and self._pool:
            return self._pool.pop()
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, ssl=self.ssl), self.timeout
            )
        except (OSError, asyncio.TimeoutError) as exc:
            raise HTTPError(f"cannot connect to {self.host}:{self.port}: {exc}") from None
        return _Connection(reader, writer)
