"""Train octavo's bundled demo model: a small Llama that completes Python code.

Trains a byte-level BPE tokenizer and a ~4M-parameter Llama on the running interpreter's standard
library (on two CPU threads by default, about an hour), and saves the result in HuggingFace format
(default: the core package's data/demo-model, the folder `octavo serve` uses when no model is
given).

    .venv/bin/python scripts/train_demo_model.py                             # the committed run
    .venv/bin/python scripts/train_demo_model.py --steps 20 --out /tmp/demo-smoke       # smoke run
    .venv/bin/python scripts/train_demo_model.py --stop-after 50 --out /tmp/demo-check  # re-run
    .venv/bin/python scripts/train_demo_model.py --report-only --out FOLDER  # re-render README
"""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread: before tokenizers loads

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from demo_model.corpus import load_corpus, stdlib_root  # noqa: E402
from demo_model.report import (  # noqa: E402
    REPETITION_PENALTY,
    greedy_samples,
    plot_loss_curve,
    render_readme,
    sampled_sample,
    write_metrics,
)
from demo_model.tokenizer import SPECIAL_TOKENS, encode_documents, to_transformers, train_tokenizer  # noqa: E402
from demo_model.training import TrainConfig, build_model, evaluate, pack_windows, train  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "core" / "octavo" / "data" / "demo-model"


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags; the defaults are the committed run's settings."""
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps", type=int, default=defaults.steps, help="optimizer steps (sets training length)"
    )
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
    parser.add_argument("--lr", type=float, default=defaults.peak_lr, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=None, help="default: 5%% of --steps")
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--stdlib", type=Path, default=None, help="stdlib directory (default: this interpreter's)"
    )
    parser.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="end after this many steps, keeping the --steps schedule (to check a run reproduces)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch CPU threads; a run is reproducible bit for bit only with the same count",
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="output folder (HuggingFace format)"
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: redo the samples of the model in --out and rewrite its metrics.json "
        "and README.md",
    )
    return parser.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The run's TrainConfig; rejects settings that cannot train."""
    if min(args.steps, args.batch_size, args.stop_after or 1) < 1:
        raise ValueError("--steps, --batch-size and --stop-after must be at least 1")
    if not 2 <= args.seq_len <= TrainConfig().shape.max_position_embeddings:
        raise ValueError(f"--seq-len must be in [2, {TrainConfig().shape.max_position_embeddings}]")
    if args.vocab_size < 512:
        raise ValueError("--vocab-size must be at least 512 (256 bytes + merges + specials)")
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 20)
    return TrainConfig(
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        steps=args.steps,
        peak_lr=args.lr,
        warmup_steps=warmup,
        seed=args.seed,
        eval_every=max(1, min(TrainConfig().eval_every, args.steps // 10)),
    )


def prepare_data(args: argparse.Namespace, config: TrainConfig):
    """Tokenizer plus training and held-out windows, with corpus statistics."""
    corpus = load_corpus(args.stdlib or stdlib_root())
    train_texts, held_out_texts = (
        corpus.read(corpus.train_files),
        corpus.read(corpus.held_out_files),
    )
    tokenizer = train_tokenizer(train_texts, config.vocab_size)
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    train_docs, held_out_docs = (
        encode_documents(tokenizer, train_texts),
        encode_documents(tokenizer, held_out_texts),
    )
    stats = {
        "stdlib": str(corpus.root),
        "train_files": len(train_texts),
        "held_out_files": len(held_out_texts),
        "train_tokens": sum(map(len, train_docs)),
        "held_out_tokens": sum(map(len, held_out_docs)),
    }
    return (
        tokenizer,
        pack_windows(train_docs, config.seq_len),
        pack_windows(held_out_docs, config.seq_len),
        stats,
    )


def save_model(model, hf_tokenizer, out: Path) -> None:
    """config.json, model.safetensors, generation_config.json and tokenizer files into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    hf_tokenizer.save_pretrained(
        out, save_jinja_files=False
    )  # chat template inside tokenizer_config.json
    # Readers older than transformers 5 know the dtype as torch_dtype and the class by its old name.
    _update_json(out / "config.json", torch_dtype="float32")
    _update_json(out / "tokenizer_config.json", tokenizer_class="PreTrainedTokenizerFast")


def _update_json(path: Path, **fields) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(fields)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def build_metrics(
    args, config: TrainConfig, corpus_stats: dict, history, held_out_loss: float, num_windows: int
) -> dict:
    """Everything about the run that metrics.json and the README report."""
    recent = history.train_loss[-50:]
    return {
        "command": reproduce_command(sys.argv[1:]),
        "config": dataclasses.asdict(config),
        "corpus": corpus_stats,
        "model_bytes": (args.out / "model.safetensors").stat().st_size,
        "steps_run": len(history.train_loss),
        "tokens_seen": len(history.train_loss) * config.batch_size * config.seq_len,
        "epochs": len(history.train_loss) * config.batch_size / num_windows,
        "threads": args.threads,
        "held_out_loss": held_out_loss,
        "held_out_perplexity": math.exp(held_out_loss),
        "final_train_loss": sum(recent) / len(recent),
        "curve": {
            "eval_steps": history.eval_steps,
            "held_out_loss_first_windows": history.eval_loss,
        },
        "train_seconds": history.train_seconds,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "cpu": _cpu_name(),
    }


def reproduce_command(argv) -> str:
    """The command line that repeats the run; --out (where it was written) does not change it."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--out":
            skip = True
        elif not arg.startswith("--out="):
            kept.append(arg)
    return shlex.join([".venv/bin/python", "scripts/train_demo_model.py", *kept])


def write_samples_and_readme(out: Path, metrics: dict) -> dict:
    """Samples from the saved folder (what a user loading it gets), then metrics.json and
    README.md."""
    saved_model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    saved_tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    metrics["samples"] = greedy_samples(saved_model, saved_tokenizer)
    metrics["repetition_penalty"] = REPETITION_PENALTY
    metrics["samples_repetition_penalty"] = greedy_samples(
        saved_model, saved_tokenizer, repetition_penalty=REPETITION_PENALTY
    )
    metrics["sampled"] = sampled_sample(saved_model, saved_tokenizer)
    write_metrics(metrics, out / "metrics.json")
    (out / "README.md").write_text(render_readme(metrics), encoding="utf-8")
    return metrics


def report_only(out: Path) -> int:
    """Redo the samples and README of an already trained folder from its metrics.json."""
    metrics = json.loads((out / "metrics.json").read_text(encoding="utf-8"))
    metrics["command"] = reproduce_command(shlex.split(metrics["command"])[2:])
    write_samples_and_readme(out, metrics)
    _print_samples(metrics)
    return 0


def _print_samples(metrics: dict) -> None:
    for prompt, completion in metrics["samples"].items():
        print(f"--- {prompt!r} (greedy)\n{prompt}{completion}")
    for prompt, completion in metrics.get("samples_repetition_penalty", {}).items():
        print(
            f"--- {prompt!r} (greedy, repetition_penalty {metrics['repetition_penalty']})\n"
            f"{prompt}{completion}"
        )
    prompt, sampled = metrics["sampled"]["prompt"], metrics["sampled"]
    print(f"--- {prompt!r} (temperature {sampled['temperature']})\n{prompt}{sampled['completion']}")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None) -> int:
    """Train, evaluate, save, sample and write the report; returns the exit status."""
    started = time.perf_counter()
    args = parse_args(argv)
    if args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    if args.report_only:
        return report_only(args.out)
    config = config_from_args(args)
    tokenizer, train_windows, held_out_windows, corpus_stats = prepare_data(args, config)
    print(
        f"corpus: {corpus_stats}; {train_windows.shape[0]} training windows of {config.seq_len}",
        flush=True,
    )
    model = build_model(config, {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS})
    history = train(model, train_windows, held_out_windows, config, stop_after=args.stop_after)
    held_out_loss = evaluate(model, held_out_windows)
    print(
        f"held-out loss {held_out_loss:.4f} nats/token over {held_out_windows.numel()} tokens",
        flush=True,
    )
    hf_tokenizer = to_transformers(tokenizer, model_max_length=config.shape.max_position_embeddings)
    save_model(model, hf_tokenizer, args.out)
    plot_loss_curve(history, config.batch_size * config.seq_len, args.out / "loss_curve.png")
    metrics = build_metrics(
        args, config, corpus_stats, history, held_out_loss, train_windows.shape[0]
    )
    metrics["parameters"] = sum(p.numel() for p in model.parameters())
    metrics["total_seconds"] = time.perf_counter() - started
    metrics = write_samples_and_readme(args.out, metrics)
    _print_samples(metrics)
    print(f"saved to {args.out} in {metrics['total_seconds'] / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as exc:
        print(f"train_demo_model: error: {exc}", file=sys.stderr)
        sys.exit(2)
