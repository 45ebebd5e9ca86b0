"""Tensor parallelism on this machine: TP = 1 against TP = 2 on the ~100M Llama, side by side in
one run, and what a TP = 2 step spends communicating.

    python benchmarks/tensor_parallel.py                     # 3 rounds, bf16 ~100M model
    python benchmarks/tensor_parallel.py --rounds 1 --out /tmp/tp.json

Throughput: ``--num-requests`` random prompts of 64-256 tokens, 64 greedy output tokens each
(EOS ignored), through ``LLM`` (``batch``), and one request of 128 tokens decoding alone
(``b1``); TP = 1 and TP = 2 alternate round by round and each figure is the median of its
rounds. The greedy tokens of the two are compared, in bf16 (the benchmark's) and in float32 (8
of the requests).

Communication: two processes time, at the model's shapes, what a TP = 2 step adds per
forward, with the cpu platform's communicator (shared memory on one host) and with gloo
(``OCTAVO_CPU_SHM=0``): an all-reduce of ``[T, hidden]`` after each attention and each MLP (2
per layer) and after the embedding, an all-gather of the logits ``[S, vocab / 2]``, and rank
0's broadcast of the step's call (a pickled ``SchedulerOutput``, its size measured from a real
step) to the other ranks; T = 1, 16 and 256 tokens (decode of one request, decode of 16, a
prefill chunk). The broadcast is set against the alternative, the same call over a pipe to a
local process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from octavo import LLM, SamplingParams
from octavo.bench.datasets import random_requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import MODEL_SPECS, make_model  # noqa: E402

SHM = {"shared-memory": "1", "gloo": "0"}
COMM_SCRIPT = r"""
import sys, time, datetime, json
import torch, torch.distributed as dist
rank, port, hidden, vocab, layers = map(int, sys.argv[1:6])
call_bytes = json.loads(sys.argv[6])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=120))
torch.set_num_threads(1)
from octavo.platform.facade import Platform
comm = Platform.select("cpu").communicator(dist.group.WORLD)  # OCTAVO_CPU_SHM picks which
results = {}
for tokens, sampled in ((1, 1), (16, 16), (256, 1)):
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    logits = torch.randn(sampled, vocab // 2, dtype=torch.bfloat16)
    parts = [torch.empty_like(logits) for _ in range(2)]
    call = b"x" * call_bytes[str(tokens)]
    timings = {}
    def timed(name, fn):
        start = time.perf_counter()
        fn()
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start
    def step():
        timed("broadcast_call", lambda: dist.broadcast_object_list([call if rank == 0 else None]))
        for _ in range(2 * layers + 1):
            timed("all_reduce", lambda: comm.all_reduce(x))
        timed("all_gather_logits", lambda: dist.all_gather(parts, logits))
    for _ in range(5):
        step()
    dist.barrier()
    timings.clear()
    n = 50
    for _ in range(n):
        step()
    results[tokens] = {k: round(v / n * 1e3, 3) for k, v in timings.items()}
    results["communicator"] = type(comm).__name__
if rank == 0:
    print(json.dumps(results), flush=True)
dist.barrier()
import os
os._exit(0)  # gloo's teardown at exit can abort when the peer leaves first
"""


def throughput(
    model: Path, tp: int, requests, params, dtype: str = "auto"
) -> tuple[float, list[list[int]]]:
    llm = LLM(
        str(model),
        dtype=dtype,
        tensor_parallel_size=tp,
        kv_cache_memory=(2 << 30) // tp,
        max_num_batched_tokens=2048,
    )
    try:
        prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests]
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return sum(map(len, tokens)) / elapsed, tokens


def call_sizes(model: Path) -> dict[int, int]:
    """Bytes of a step's pickled call (its SchedulerOutput) from a real engine: a 256-token
    prefill, a decode of one request and a decode of 16."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    def first_call_after(prompts: list[list[int]], steps: int) -> int:
        llm = LLM(str(model), kv_cache_memory=1 << 28, max_num_batched_tokens=256)
        for i, prompt in enumerate(prompts):
            llm.engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        for _ in range(steps):
            llm.engine.step()
        output = llm.engine.core.scheduler.schedule()
        return len(pickle.dumps(("execute_model", (output,), False)))

    return {
        256: first_call_after([list(range(1, 257))], 0),
        1: first_call_after([[1, 2, 3]], 1),
        16: first_call_after([[1, 2, 3 + i] for i in range(16)], 1),
    }


def communication(spec, call_bytes: dict[int, int], shm: str) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "comm.py"
        script.write_text(COMM_SCRIPT)
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        args = [str(port), str(spec.hidden_size), str(spec.vocab_size)]
        args += [str(spec.num_hidden_layers), json.dumps(call_bytes)]
        ranks = [
            subprocess.Popen(
                [sys.executable, str(script), str(rank), *args],
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, "OCTAVO_CPU_SHM": shm},
            )
            for rank in range(2)
        ]
        out = [p.communicate(timeout=600)[0] for p in ranks]
    return json.loads(out[0].strip().splitlines()[-1])


def _echo(conn) -> None:
    while (message := conn.recv()) is not None:
        conn.send(len(message))


def pipe_ms(call_bytes: dict[int, int], n: int = 500) -> dict[int, float]:
    """The alternative to the broadcast: a call sent over a multiprocessing pipe to another
    process on this host (one way: half a round trip with a tiny answer)."""
    import multiprocessing

    mine, theirs = multiprocessing.get_context("spawn").Pipe()
    child = multiprocessing.get_context("spawn").Process(target=_echo, args=(theirs,))
    child.start()
    results = {}
    for tokens, size in call_bytes.items():
        call = ("execute_model", (b"x" * size,), False)
        for _ in range(20):
            mine.send(call)
            mine.recv()
        start = time.perf_counter()
        for _ in range(n):
            mine.send(call)
            mine.recv()
        results[tokens] = round((time.perf_counter() - start) / n / 2 * 1e3, 3)
    mine.send(None)
    child.join()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=Path("/tmp/small-llama"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = make_model("small", args.model)
    spec = MODEL_SPECS["small"]
    requests = random_requests(args.num_requests, (64, 256), (64, 64), spec.vocab_size, seed=21)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    alone = random_requests(1, (64, 64), (128, 128), spec.vocab_size, seed=22)
    alone_params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    workloads = {"batch": (requests, params), "b1": (alone, alone_params)}
    rates = {(w, tp): [] for w in workloads for tp in (1, 2)}
    tokens: dict[int, list] = {}
    for _ in range(args.rounds):
        for workload, (reqs, sampling) in workloads.items():
            for tp in (1, 2):  # TP = 2 with the shared-memory all-reduce (the default)
                rate, out = throughput(model, tp, reqs, sampling)
                if workload == "batch":
                    tokens[tp] = out
                rates[(workload, tp)].append(rate)
                print(f"{workload} TP={tp}: {rate:.1f} output tok/s", flush=True)
    same = sum(a == b for a, b in zip(tokens[1], tokens[2]))
    fp32 = [throughput(model, tp, requests[:8], params, "float32")[1] for tp in (1, 2)]
    same_fp32 = sum(a == b for a, b in zip(*fp32))
    call_bytes = call_sizes(model)
    comm = {name: communication(spec, call_bytes, shm) for name, shm in SHM.items()}
    report = {
        "date": datetime.date.today().isoformat(),
        "model": f"~100M Llama bf16 ({spec.num_hidden_layers} layers, hidden {spec.hidden_size})",
        "output_tok_s": {f"{w} TP={tp}": statistics.median(r) for (w, tp), r in rates.items()},
        "rounds": {f"{w} TP={tp}": r for (w, tp), r in rates.items()},
        "identical_greedy_requests_bf16": f"{same}/{len(tokens[1])}",
        "identical_greedy_requests_fp32": f"{same_fp32}/{len(fp32[0])}",
        "call_bytes_by_tokens": call_bytes,
        "comm_ms_per_forward": comm,
        "pipe_call_ms": pipe_ms(call_bytes),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
