"""``octavo bench serve``: streaming ``/v1/completions`` load against any OpenAI-compatible server.

Prompts are token ids, so the same workload measures octavo, vLLM and llama.cpp alike. For each
concurrency of the sweep, requests are sent (optionally with Poisson arrivals at
``--request-rate``) until ``--num-prompts`` are done or ``--duration`` seconds have passed; TTFT,
ITL, TPOT and end-to-end latency percentiles and request/token throughput are reported per
concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
from tqdm.auto import tqdm

from octavo.bench.datasets import BenchRequest, add_dataset_args, load_requests
from octavo.bench.http_client import HTTPClient, HTTPError
from octavo.bench.report import SPEC_COLUMNS, plot_serve, print_table, summarize, write_json

DEFAULT_CONCURRENCY = "1,10,50,100"


@dataclasses.dataclass(slots=True)
class RequestResult:
    """What one streamed request measured (seconds); ``error`` is set when it failed."""

    prompt_len: int
    ttft: float = math.nan
    latency: float = math.nan
    itl: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    error: Optional[str] = None


def add_serve_bench_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Target, load shape, dataset and output flags of ``octavo bench serve``."""
    parser.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)"
    )
    parser.add_argument(
        "--model", default=None, help="model name to request (default: the first of /v1/models)"
    )
    parser.add_argument(
        "--lora-modules",
        default=None,
        help="comma-separated LoRA adapter names the server serves: request i asks for the "
        "(i mod N)-th, so the adapters are mixed in every batch (vLLM's benchmark picks at random)",
    )
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer folder for sharegpt and the vocabulary size"
    )
    parser.add_argument(
        "--vocab-size", type=int, default=None, help="random/prefix token ids are drawn below this"
    )
    parser.add_argument(
        "--max-concurrency", default=DEFAULT_CONCURRENCY, help="comma-separated concurrency sweep"
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (default: all at once)",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help="stop sending new requests after this many seconds",
    )
    parser.add_argument("--num-warmups", type=int, default=1)
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a request may take from sending it to its last byte",
    )
    parser.add_argument(
        "--server-pid", type=int, default=None, help="sample this process's peak resident memory"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--no-keep-alive",
        action="store_true",
        help="a new connection for every request (sent with Connection: close), for servers "
        "that close a connection after a streamed response although they offer keep-alive "
        "(llama.cpp's llama-server; a pooled connection found closed is retried on a new one "
        "either way, one connection per request spares the failed attempt)",
    )
    parser.add_argument("--output-json", type=Path, default=None)
    parser.add_argument(
        "--plot", type=Path, default=None, help="write PLOT_throughput.png and PLOT_ttft.png"
    )
    parser.add_argument("--disable-tqdm", action="store_true")
    add_dataset_args(parser)
    return parser


def _parse_sweep(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(
            "--max-concurrency must be comma-separated integers >= 1, "
            f"e.g. {DEFAULT_CONCURRENCY}; got {text!r}"
        )
    return levels


async def send_request(client: HTTPClient, model: str, request: BenchRequest) -> RequestResult:
    """Stream one completion; record the arrival of every chunk carrying a token."""
    body = {
        "model": model,
        "prompt": list(request.prompt_token_ids),
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(prompt_len=len(request.prompt_token_ids))
    start = last = time.perf_counter()
    chunks = 0
    try:
        async for now, data in client.post_stream("/v1/completions", json.dumps(body).encode()):
            if data == b"[DONE]":
                continue
            chunk = json.loads(data)
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
            choice = (chunk.get("choices") or [{}])[0]
            if not chunk.get("choices") or (not choice.get("text") and choice.get("finish_reason")):
                continue
            if chunks == 0:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last, chunks = now, chunks + 1
    except (HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    if chunks == 0:
        result.error = "the stream carried no token"
    return result


async def _sample_peak_rss(pid: int, peak: list[int], stop: asyncio.Event) -> None:
    import psutil

    process = psutil.Process(pid)
    while not stop.is_set():
        try:
            rss = process.memory_info().rss + sum(
                c.memory_info().rss for c in process.children(recursive=True)
            )
        except psutil.Error:
            return
        peak[0] = max(peak[0], rss)
        await asyncio.sleep(0.05)


async def run_level(
    client,
    models: Sequence[str],
    requests: Sequence[BenchRequest],
    concurrency: int,
    args,
    progress,
) -> dict[str, Any]:
    """Send ``requests`` with at most ``concurrency`` in flight, request ``i`` to
    ``models[i % len(models)]``; the figures of this level."""
    slots = asyncio.Semaphore(concurrency)
    rng = np.random.default_rng(args.seed)
    peak, stop = [0], asyncio.Event()
    sampler = (
        asyncio.create_task(_sample_peak_rss(args.server_pid, peak, stop))
        if args.server_pid
        else None
    )

    async def one(request: BenchRequest, model: str) -> RequestResult:
        try:
            return await send_request(client, model, request)
        finally:
            slots.release()
            progress.update(1)

    start, cpu_start = time.perf_counter(), time.process_time()
    tasks = []
    for i, request in enumerate(requests):
        if math.isfinite(args.request_rate) and tasks:
            await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        await slots.acquire()
        if args.duration is not None and time.perf_counter() - start >= args.duration:
            slots.release()
            break
        tasks.append(asyncio.create_task(one(request, models[i % len(models)])))
    results = await asyncio.gather(*tasks)
    elapsed, client_cpu = time.perf_counter() - start, time.process_time() - cpu_start
    stop.set()
    if sampler:
        await sampler
    figures = level_figures(results, elapsed, concurrency, peak[0] or None)
    # What measuring cost: on a small host the client's CPU time is taken from the server.
    figures["client_cpu_ms_per_output_token"] = (
        1000 * client_cpu / figures["output_tokens"] if figures["output_tokens"] else None
    )
    return figures


def level_figures(
    results: Sequence[RequestResult], elapsed: float, concurrency: int, peak_rss: Optional[int]
) -> dict[str, Any]:
    """Throughput and latency percentiles of one level's finished requests."""
    done = [r for r in results if r.error is None]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_len for r in done)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    figures: dict[str, Any] = {
        "max_concurrency": concurrency,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(done) / elapsed,
        "output_throughput": output_tokens / elapsed,
        "total_token_throughput": (prompt_tokens + output_tokens) / elapsed,
        **summarize("ttft", [r.ttft for r in done]),
        **summarize("tpot", tpot),
        **summarize("itl", [gap for r in done for gap in r.itl]),
        **summarize("e2el", [r.latency for r in done]),
    }
    if peak_rss:
        figures["server_peak_rss_mib"] = peak_rss / 2**20
    return figures


def _workload(args: argparse.Namespace) -> list[BenchRequest]:
    tokenizer_path = args.tokenizer or (
        args.model if args.model and Path(args.model).is_dir() else None
    )
    tokenizer = None
    if tokenizer_path:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    vocab_size = args.vocab_size or (len(tokenizer) if tokenizer is not None else None)
    if vocab_size is None and args.dataset != "sharegpt":
        raise ValueError(
            "give --vocab-size N or --tokenizer FOLDER so random token ids stay inside the "
            "model's vocabulary"
        )
    return load_requests(
        args, vocab_size or 0, encode=tokenizer.encode if tokenizer is not None else None
    )


SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


async def spec_decode_counters(client) -> Optional[dict[str, float]]:
    """The server's speculative-decoding counters from its /metrics (octavo's
    ``octavo_spec_decode_*`` or vLLM's ``vllm:spec_decode_*``), None when it has none."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        status, text = await client.get("/metrics")
    except HTTPError:  # a server without /metrics reports no acceptance
        return None
    if status != 200:
        return None
    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            for name in SPEC_COUNTERS:
                if sample.name.endswith(f"spec_decode_{name}_total") and not sample.labels:
                    counters[name] = counters.get(name, 0.0) + sample.value
    return counters if len(counters) == len(SPEC_COUNTERS) else None


def spec_decode_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Acceptance over one level, from the counters before and after it."""
    drafts, draft_tokens, accepted = (after[n] - before[n] for n in SPEC_COUNTERS)
    return {
        "spec_num_drafts": drafts,
        "spec_acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "spec_mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
    }


async def _model_name(client: HTTPClient) -> str:
    status, body = await client.get("/v1/models")
    if status != 200:
        raise HTTPError(f"GET /v1/models answered HTTP {status}: {body[:200]!r}")
    return json.loads(body)["data"][0]["id"]


async def run_sweep(
    args: argparse.Namespace, requests: Sequence[BenchRequest]
) -> list[dict[str, Any]]:
    """Every concurrency of the sweep, one after another, on one HTTP client (its connections
    reused unless ``--no-keep-alive``)."""
    levels = _parse_sweep(args.max_concurrency)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with HTTPClient(
        args.base_url,
        headers=headers,
        keep_alive=not args.no_keep_alive,
        timeout=args.request_timeout,
    ) as client:
        model = args.model or await _model_name(client)
        models = args.lora_modules.split(",") if getattr(args, "lora_modules", None) else [model]
        for i, request in enumerate(requests[: args.num_warmups]):
            warm = await send_request(client, models[i % len(models)], request)
            if warm.error:
                raise ValueError(f"the warm-up request to {args.base_url} failed: {warm.error}")
        runs = []
        for concurrency in levels:
            before = await spec_decode_counters(client)
            with tqdm(
                total=len(requests), desc=f"concurrency {concurrency}", disable=args.disable_tqdm
            ) as progress:
                runs.append(await run_level(client, models, requests, concurrency, args, progress))
            after = await spec_decode_counters(client)
            if before is not None and after is not None:
                runs[-1].update(spec_decode_figures(before, after))
    return runs


def main(args: argparse.Namespace) -> int:
    """Build the workload, run the sweep, print the table, write JSON and plots when asked."""
    requests = _workload(args)
    runs = asyncio.run(run_sweep(args, requests))
    print_table(
        runs,
        [
            "max_concurrency",
            "completed",
            "failed",
            "request_throughput",
            "output_throughput",
            "ttft_p50_ms",
            "ttft_p95_ms",
            "itl_p50_ms",
            "itl_p95_ms",
            "tpot_p50_ms",
            "e2el_p99_ms",
            *(SPEC_COLUMNS if runs and "spec_num_drafts" in runs[0] else ()),
        ],
    )
    result = {
        "benchmark": "serve",
        "base_url": args.base_url,
        "dataset": args.dataset,
        "num_prompts": len(requests),
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "runs": runs,
    }
    write_json(args.output_json, result)
    if args.plot:
        for path in plot_serve(runs, args.plot):
            print(f"wrote {path}")
    return 0 if all(r["failed"] == 0 for r in runs) else 1
