"""A soak test of `octavo serve` on loopback: mixed traffic at a fraction of the measured
capacity for a while, then a drain and a SIGTERM with streams in flight.

    .venv/bin/python benchmarks/soak.py [--model PATH] [--duration 600] [--load 0.8]
        [--out out/soak] [-- extra `octavo serve` flags]

1. Starts `octavo serve` (the bundled demo model unless --model) with vLLM's metric names.
2. Measures capacity: completed requests a second of the standard request (a streamed
   completion of --max-tokens tokens) from --capacity-concurrency closed-loop clients.
3. Sends Poisson arrivals at --load times that rate for --duration seconds, each one of:
   - a streamed completion;
   - a completion that is not streamed;
   - a streamed chat completion;
   - a stream the client drops after its first chunk (a cancellation);
   - a bad request, which must get a 400 with an OpenAI error body.
   Every 5 s it samples the server's resident memory and its /metrics gauges.
4. Stops the arrivals, waits for what is in flight, and reads the KV cache's usage once the
   engine is idle: 0 means no block is in use.
5. Starts a few streams, sends SIGTERM, and checks that they end with [DONE] and that the
   server exits 0.

It writes RESULTS.json (every request, every sample, the summary) and a plot, `soak.png`:
latency p50/p99 and resident memory over time. It exits 1 when a check fails:
- an unexpected error (a 5xx, a dropped connection the client did not drop, a bad request not
  refused with 400);
- resident memory growing 5% or more from the end of warm-up (the first fifth) to the end;
- blocks in use after the drain;
- a stream cut off by the SIGTERM, or a non-zero exit.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx2 as httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

KINDS = {  # kind: weight
    "stream": 0.40,
    "complete": 0.25,
    "chat_stream": 0.15,
    "cancel": 0.10,
    "bad": 0.10,
}
BAD_BODIES = (  # each must be refused with 400 and the param named
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "temperature": -2}, "temperature"),
    ({"prompt": "hi", "top_p": 7}, "top_p"),
)
PROMPTS = (
    "Once upon a time",
    "The quick brown fox",
    "In a small village by the sea, there lived",
    "Write a short story about a robot who learns to paint.",
    "List the planets of the solar system and say one thing about each.",
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled demo model")
    parser.add_argument("--served-model-name", default="soak")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    parser.add_argument("--load", type=float, default=0.8, help="fraction of the capacity")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--capacity-concurrency", type=int, default=16)
    parser.add_argument("--capacity-seconds", type=float, default=20.0)
    parser.add_argument("--sample-every", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("out/soak"))
    parser.add_argument("serve_args", nargs="*", help="more `octavo serve` flags, after --")
    return parser.parse_args(argv)


@dataclasses.dataclass
class Outcome:
    kind: str
    start: float  # seconds since the soak began
    latency: float
    ok: bool
    detail: str = ""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "octavo.cli", "serve"]
    command += [args.model] if args.model else []
    command += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name"]
    command += [args.served_model_name, "--metrics-naming", "vllm", "--disable-log-requests"]
    command += ["--uvicorn-log-level", "warning", *args.serve_args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while True:
        if process.poll() is not None:
            raise SystemExit(f"the server exited: {process.stdout.read().decode()[-3000:]}")
        if time.monotonic() > deadline:
            process.kill()
            raise SystemExit("the server did not come up in 300 s")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.2)


class Traffic:
    """The requests of each kind, over one client."""

    def __init__(self, client: httpx.AsyncClient, model: str, max_tokens: int, seed: int):
        self.client, self.model, self.max_tokens = client, model, max_tokens
        self.random = random.Random(seed)

    def completion_body(self, stream: bool) -> dict:
        return {
            "model": self.model,
            "prompt": self.random.choice(PROMPTS),
            "max_tokens": self.max_tokens,
            "temperature": self.random.choice((0.0, 0.7)),
            "stream": stream,
        }

    async def stream(self, path: str, body: dict, drop_after: Optional[int] = None) -> str:
        """Reads a stream to its end ([DONE]) or drops it after ``drop_after`` chunks."""
        chunks = 0
        async with self.client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                return f"status {response.status_code}: {(await response.aread())[:200]!r}"
            async for line in response.aiter_lines():
                if not line:
                    continue
                if line == "data: [DONE]":
                    return "" if drop_after is None else "ended before it was dropped"
                chunks += 1
                if drop_after is not None and chunks >= drop_after:
                    return ""  # leaving the block closes the connection: a cancellation
        return "the stream ended without [DONE]"

    async def run(self, kind: str) -> str:
        """'' when the request behaved, else what went wrong."""
        if kind == "stream":
            return await self.stream("/v1/completions", self.completion_body(True))
        if kind == "cancel":
            # Dropped after its first chunk: every stream has one before [DONE], so this is
            # always a cancellation (the engine may have finished the request already).
            return await self.stream("/v1/completions", self.completion_body(True), drop_after=1)
        if kind == "chat_stream":
            body = {
                "model": self.model,
                "messages": [{"role": "user", "content": self.random.choice(PROMPTS)}],
                "max_tokens": self.max_tokens,
                "stream": True,
            }
            return await self.stream("/v1/chat/completions", body)
        if kind == "complete":
            response = await self.client.post("/v1/completions", json=self.completion_body(False))
            if response.status_code != 200:
                return f"status {response.status_code}: {response.text[:200]}"
            usage = response.json()["usage"]
            return "" if usage["completion_tokens"] >= 1 else f"no tokens: {usage}"
        body, param = self.random.choice(BAD_BODIES)
        response = await self.client.post("/v1/completions", json={"model": self.model, **body})
        error = response.json().get("error", {}) if response.status_code == 400 else {}
        if response.status_code != 400 or error.get("param") != param:
            return f"bad request {body} got {response.status_code}: {response.text[:200]}"
        return ""


async def timed(traffic: Traffic, kind: str, t0: float) -> Outcome:
    start = time.monotonic()
    try:
        detail = await traffic.run(kind)
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        detail = f"{type(exc).__name__}: {exc}"
    return Outcome(kind, start - t0, time.monotonic() - start, not detail, detail)


def scrape(base_url: str) -> dict[str, float]:
    """The /metrics samples without labels other than model_name/engine, by name."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            extra = {k: v for k, v in sample.labels.items() if k not in ("model_name", "engine")}
            if not extra:
                samples[sample.name] = sample.value
    return samples


async def measure_capacity(traffic: Traffic, concurrency: int, seconds: float) -> float:
    """Completed standard requests a second from ``concurrency`` closed-loop clients."""
    deadline = time.monotonic() + seconds
    done = 0

    async def worker() -> None:
        nonlocal done
        while time.monotonic() < deadline:
            if not await traffic.run("stream"):
                done += 1

    start = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.monotonic() - start)


async def soak(args: argparse.Namespace, base_url: str, process: psutil.Process) -> dict:
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        traffic = Traffic(client, args.served_model_name, args.max_tokens, args.seed)
        capacity = await measure_capacity(traffic, args.capacity_concurrency, args.capacity_seconds)
        rate = args.load * capacity
        print(f"capacity {capacity:.2f} req/s; soaking at {rate:.2f} req/s for {args.duration} s")
        arrivals = random.Random(args.seed + 1)
        kinds, weights = list(KINDS), list(KINDS.values())
        tasks, samples = [], []
        t0 = time.monotonic()
        next_sample = 0.0
        now = 0.0
        while now < args.duration:
            now = time.monotonic() - t0
            if now >= next_sample:
                gauges = scrape(base_url)
                samples.append(
                    {
                        "t": now,
                        "rss_mib": process.memory_info().rss / 2**20,
                        "running": gauges.get("vllm:num_requests_running"),
                        "waiting": gauges.get("vllm:num_requests_waiting"),
                        "kv_usage": gauges.get("vllm:kv_cache_usage_perc"),
                    }
                )
                next_sample += args.sample_every
            kind = arrivals.choices(kinds, weights)[0]
            tasks.append(asyncio.create_task(timed(traffic, kind, t0)))
            await asyncio.sleep(arrivals.expovariate(rate))
        outcomes = await asyncio.gather(*tasks)
        drained_at = time.monotonic() - t0
        deadline = time.monotonic() + 60
        while True:  # the engine's own view: nothing running or waiting
            gauges = scrape(base_url)
            idle = (
                not gauges["vllm:num_requests_running"] and not gauges["vllm:num_requests_waiting"]
            )
            if idle or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        samples.append({"t": time.monotonic() - t0, "rss_mib": process.memory_info().rss / 2**20})
        kv_after_drain = gauges["vllm:kv_cache_usage_perc"]
        # SIGTERM with streams in flight: each must still end with [DONE].
        body = traffic.completion_body(True) | {"max_tokens": 4 * args.max_tokens}
        in_flight = [asyncio.create_task(traffic.stream("/v1/completions", body)) for _ in range(4)]
        await asyncio.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        cut = [detail for detail in await asyncio.gather(*in_flight) if detail]
    return {
        "capacity_rps": capacity,
        "rate_rps": rate,
        "outcomes": [dataclasses.asdict(o) for o in outcomes],
        "samples": samples,
        "drained_at_s": drained_at,
        "kv_usage_after_drain": kv_after_drain,
        "streams_cut_by_sigterm": cut,
    }


def summarize(result: dict, exit_code: int) -> dict:
    outcomes = result["outcomes"]
    errors = [o for o in outcomes if not o["ok"]]
    rss = [s["rss_mib"] for s in result["samples"]]
    warm = rss[max(1, len(rss) // 5)] if len(rss) > 1 else rss[0]
    growth = (rss[-1] - warm) / warm
    good = sorted(o["latency"] for o in outcomes if o["ok"] and o["kind"] != "bad")
    summary = {
        "requests": len(outcomes),
        "by_kind": {k: sum(o["kind"] == k for o in outcomes) for k in KINDS},
        "unexpected_errors": len(errors),
        "first_errors": [o["detail"] for o in errors[:5]],
        "latency_p50_s": statistics.median(good) if good else None,
        "latency_p99_s": good[int(0.99 * (len(good) - 1))] if good else None,
        "rss_mib_after_warmup": warm,
        "rss_mib_at_end": rss[-1],
        "rss_growth": growth,
        "kv_usage_after_drain": result["kv_usage_after_drain"],
        "streams_cut_by_sigterm": len(result["streams_cut_by_sigterm"]),
        "exit_code": exit_code,
    }
    summary["passed"] = (
        not errors
        and growth < 0.05
        and result["kv_usage_after_drain"] == 0.0
        and not result["streams_cut_by_sigterm"]
        and exit_code == 0
    )
    return summary


def plot(result: dict, path: Path, window: float = 30.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outcomes = [o for o in result["outcomes"] if o["ok"] and o["kind"] != "bad"]
    end = max((o["start"] for o in outcomes), default=0.0)
    starts, p50, p99 = [], [], []
    t = 0.0
    while t <= end:
        lat = sorted(o["latency"] for o in outcomes if t <= o["start"] < t + window)
        if lat:
            starts.append((t + window / 2) / 60)
            p50.append(statistics.median(lat))
            p99.append(lat[int(0.99 * (len(lat) - 1))])
        t += window
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(starts, p50, label="p50")
    top.plot(starts, p99, label="p99")
    top.set_ylabel(f"request latency (s), {window:.0f} s windows")
    top.legend()
    top.grid(alpha=0.3)
    samples = result["samples"]
    bottom.plot([s["t"] / 60 for s in samples], [s["rss_mib"] for s in samples])
    bottom.set_ylabel("server resident memory (MiB)")
    bottom.set_xlabel("minutes")
    bottom.grid(alpha=0.3)
    figure.suptitle(
        f"octavo soak: {result['rate_rps']:.2f} req/s "
        f"({result['rate_rps'] / result['capacity_rps']:.0%} of capacity)"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = start_server(args, port)
    try:
        result = asyncio.run(soak(args, f"http://127.0.0.1:{port}", psutil.Process(server.pid)))
        exit_code = server.wait(timeout=120)
    finally:
        if server.poll() is None:
            server.kill()
    result["summary"] = summarize(result, exit_code)
    result["command"] = " ".join([os.path.basename(sys.executable), *sys.argv])
    (args.out / "RESULTS.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "soak.png")
    print(json.dumps(result["summary"], indent=1))
    return 0 if result["summary"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
