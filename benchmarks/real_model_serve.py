"""Serving the real model (benchmarks/real_model.py) side by side: octavo on each format against
llama.cpp's ``llama-server`` on the same GGUF files, engines alternated round by round, measured
by ``octavo bench serve`` (streaming /v1/completions, random token-id prompts).

    python benchmarks/real_model_serve.py [--formats Q8_0,Q4_0] [--concurrency 1,8]
        [--rounds 2] [--num-prompts 16] [--input-len 128 256] [--output-len 64] [--out FILE]

Each (engine, format, round) starts its server, sweeps the concurrency levels and stops it;
the table gives each level's median over rounds of output tok/s and ITL p50 (ms). llama-server
runs with an f32 KV cache and no flash attention, one slot per request in flight, its default
threads (2 here), as benchmarks/compare/run.py starts it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = HERE / ".models" / "smollm2-135m-instruct"
LLAMA_SERVER = HERE / "compare" / ".llama-cpp" / "llama.cpp" / "build" / "bin" / "llama-server"
VOCAB = 49152


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="Q8_0,Q4_0")
    parser.add_argument("--engines", default="octavo,llamacpp")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, nargs=2, default=(128, 256))
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def model_file(fmt: str) -> Path:
    return MODEL / ("SmolLM2-135M-Instruct.Q4_1.gguf" if fmt == "Q4_1" else f"model.{fmt}.gguf")


def server_command(engine: str, fmt: str, port: int, slots: int, context: int) -> list[str]:
    if engine == "llamacpp":
        return [str(LLAMA_SERVER), "-m", str(model_file(fmt)), "--host", "127.0.0.1"]
    model = {"bf16": MODEL / "hf", "int8": MODEL / "hf-f32"}.get(fmt, model_file(fmt))
    command = [str(HERE.parent / ".venv" / "bin" / "octavo"), "serve", str(model)]
    command += ["--host", "127.0.0.1", "--max-model-len", str(context)]
    return command + (["--quantization", "int8", "--dtype", "float32"] if fmt == "int8" else [])


def start(engine: str, fmt: str, slots: int, context: int, log, extra=()) -> tuple:
    """``(process, port)`` of the engine's server once /health answers (``extra``: more
    flags)."""
    port = free_port()
    command = server_command(engine, fmt, port, slots, context) + ["--port", str(port), *extra]
    if engine == "llamacpp":
        command += ["-np", str(slots), "-c", str(slots * context), "-ctk", "f32", "-ctv", "f32"]
        command += ["-fa", "off"]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    health = f"http://127.0.0.1:{port}/health"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(health, timeout=2).status == 200:
                return process, port
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"{engine} {fmt} did not start")


def sweep(engine: str, port: int, pid: int, args, extra=()) -> dict:
    """``octavo bench serve``'s JSON for the sweep ``args`` ask for (``extra``: more flags)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, "-m", "octavo.cli", "bench", "serve"]
        command += ["--base-url", f"http://127.0.0.1:{port}", "--vocab-size", str(VOCAB)]
        command += ["--dataset", "random", "--input-len", *map(str, args.input_len)]
        command += ["--output-len", str(args.output_len), str(args.output_len)]
        command += ["--num-prompts", str(args.num_prompts), "--max-concurrency", args.concurrency]
        command += ["--server-pid", str(pid), "--output-json", out.name, "--disable-tqdm"]
        command += ["--no-keep-alive"] if engine == "llamacpp" else []
        subprocess.run([*command, *extra], check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def main(argv=None) -> None:
    args = parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    context = -(-(args.input_len[1] + args.output_len) // 256) * 256
    runs: dict = {}
    for round_index in range(args.rounds):
        for fmt in args.formats.split(","):
            engines = args.engines.split(",")
            for engine in engines if round_index % 2 == 0 else engines[::-1]:
                if engine == "llamacpp" and fmt in ("bf16", "int8"):
                    continue
                with open(os.devnull, "w") as log:
                    process, port = start(engine, fmt, max(levels), context, log)
                    try:
                        result = sweep(engine, port, process.pid, args)
                    finally:
                        process.terminate()
                        process.wait(timeout=30)
                runs.setdefault((engine, fmt), []).append(result)
                print(f"round {round_index} {engine} {fmt} done", flush=True)
    print_table(runs, levels)
    if args.out:
        args.out.write_text(json.dumps({f"{e} {f}": r for (e, f), r in runs.items()}, indent=2))


def print_table(runs: dict, levels: list[int]) -> None:
    print("| engine | format | " + " | ".join(f"c={c} tok/s, ITL p50" for c in levels) + " |")
    print("|---|---|" + "---|" * len(levels))
    for (engine, fmt), results in runs.items():
        cells = []
        for level in levels:
            rows = [r for res in results for r in res["runs"] if r["max_concurrency"] == level]
            tok_s = statistics.median(r["output_throughput"] for r in rows)
            itl = statistics.median(r["itl_p50_ms"] for r in rows)
            cells.append(f"{tok_s:.0f}, {itl:.2f} ms")
        print(f"| {engine} | {fmt} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
