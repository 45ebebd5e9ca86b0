"""``octavo train-draft``: train a draft head for a target model on text, on the CPU, seeded;
save it as a folder ``speculative_config.model`` takes, with its loss curve, its settings and
measured acceptance on held-out text in ``metrics.json`` and a README."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from octavo.train_draft.data import TextFiles, read_texts, shuffled_batches, token_windows
from octavo.train_draft.eagle import EagleTraining, TrainableEagleHead, loss_of
from octavo.train_draft.gumiho import GumihoTraining, TrainableGumihoHead, gumiho_loss_of
from octavo.train_draft.p_eagle import ParallelTraining, TrainableParallelHead, parallel_loss_of

# method -> (trainable head, its settings, its loss, the speculative_config it is served with)
METHODS = {
    "eagle": (TrainableEagleHead, EagleTraining, loss_of, {}),
    "p-eagle": (
        TrainableParallelHead,
        ParallelTraining,
        parallel_loss_of,
        {"parallel_drafting": True},
    ),
    "gumiho": (TrainableGumihoHead, GumihoTraining, gumiho_loss_of, {"method": "gumiho"}),
}


def add_train_draft_parser(commands) -> None:
    parser = commands.add_parser(
        "train-draft",
        help="train a draft head (EAGLE, P-EAGLE, Gumiho) for a target model on text, on the CPU",
    )
    parser.add_argument("target", help="the target model's local folder")
    parser.add_argument("--method", choices=list(METHODS), default="eagle")
    parser.add_argument("--data", required=True, help="a text file, or a folder of them")
    parser.add_argument("--pattern", default="*.py", help="files of --data to read (glob)")
    parser.add_argument(
        "--exclude",
        action="append",
        default=[],
        help="a folder name under --data to leave out (repeatable)",
    )
    parser.add_argument("--out", required=True, help="the folder to write the head to")
    parser.add_argument(
        "--init",
        default=None,
        help="a trained head's folder to start from (for example an EAGLE head for a P-EAGLE "
        "or Gumiho head of the same target): each tensor this head has by the same name and "
        "shape starts from it, the others from the seed",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=1,
        help="the head's decoder layers (default 1; with --init, the layers past the init "
        "head's start as the identity, so training starts from that head's drafts)",
    )
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="stop after this many of --steps (same schedule): to check a re-run's first "
        "losses against a run's metrics.json; the acceptance is not measured",
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--window", type=int, default=256, help="tokens per training window")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--eval-prompts", type=int, default=32, help="held-out prompts to measure acceptance on"
    )
    parser.set_defaults(run=run_train_draft)


def run_train_draft(args: argparse.Namespace) -> int:
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if args.layers < 1:
        raise ValueError(f"--layers is {args.layers}; a head has at least one decoder layer")
    torch.manual_seed(args.seed)
    target_dir, out = Path(args.target), Path(args.out)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = LlamaForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
    for param in target.parameters():
        param.requires_grad_(False)
    files = TextFiles.find(Path(args.data), args.pattern, args.exclude)
    windows = token_windows(
        tokenizer, read_texts(files.train), args.window + 1, tokenizer.eos_token_id
    )
    head_cls, settings_cls, loss_fn, serving = METHODS[args.method]
    method = settings_cls()
    config = head_cls.checkpoint_config(
        json.loads((target_dir / "config.json").read_text()), method, args.layers
    )
    head = head_cls(LlamaConfig(**config), target)
    init = None if args.init is None else warm_start(head, config, Path(args.init))
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95))
    history = _train(head, optimizer, windows, args, lambda batch: loss_fn(head, batch, method))
    out.mkdir(parents=True, exist_ok=True)
    _save(head, config, out)
    metrics = {
        "method": args.method,
        "settings": {
            **{k: v for k, v in vars(args).items() if k not in ("run", "command")},
            **dataclasses.asdict(method),
        },
        "data": {
            "train_files": len(files.train),
            "held_out_files": len(files.held_out),
            "train_windows": len(windows),
        },
        "init": init,
        "history": history,
        "acceptance": None,
    }
    _plot(history, out / "loss_curve.png")
    metrics_path = out / "metrics.json"  # written before the measurement, kept if it fails
    metrics_path.write_text(json.dumps(metrics, indent=2, default=str) + "\n")
    if args.stop_after is None:
        acceptance = measure_acceptance(
            target_dir, out, files, tokenizer, args.eval_prompts, serving
        )
        metrics["acceptance"] = acceptance
        metrics_path.write_text(json.dumps(metrics, indent=2, default=str) + "\n")
    print(json.dumps({"acceptance": metrics["acceptance"], "final": history[-1]}, indent=2))
    return 0


def warm_start(head: TrainableEagleHead, config: dict, folder: Path) -> dict:
    """Load into ``head`` (of checkpoint ``config``) the tensors of the head in ``folder`` that
    it has by name and shape, and make its layers that got none the identity (zero output
    projections: the head starts from the loaded one's predictions); what was loaded, what
    keeps its seeded initial values and which layers start as the identity."""
    from safetensors.torch import load_file

    where = f"--init {str(folder)!r}"
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise ValueError(f"{where} is not a head folder (config.json and model.safetensors)")
    init_config = json.loads((folder / "config.json").read_text())
    for field in ("hidden_size", "vocab_size"):
        if init_config.get(field) != config[field]:
            raise ValueError(
                f"{where} was trained for a target with {field} {init_config.get(field)}, this "
                f"target has {config[field]}: start from a head of this target"
            )
    own = head.head_state_dict()
    tensors = load_file(str(folder / "model.safetensors"))
    shared = {k: v for k, v in tensors.items() if k in own and own[k].shape == v.shape}
    if not shared:
        raise ValueError(f"{where} has no tensor of this head's names and shapes")
    head.load_state_dict(shared, strict=False)
    added = [
        i
        for i in range(len(head.layers))
        if not any(name.startswith(f"layers.{i}.") for name in shared)
    ]
    with torch.no_grad():  # a residual layer whose outputs are zero passes its input on
        for i in added:
            head.layers[i].self_attn.o_proj.weight.zero_()
            head.layers[i].mlp.down_proj.weight.zero_()
    return {
        "folder": str(folder),
        "loaded": sorted(shared),
        "from_seed": sorted(set(own) - set(shared)),
        "identity_layers": added,
    }


def _train(head, optimizer, windows, args, loss_of_batch) -> list[dict]:
    from tqdm import tqdm

    batches = shuffled_batches(windows, args.batch_size, args.seed)
    warmup = max(1, args.steps // 20)
    history, started = [], time.perf_counter()
    num_steps = args.steps if args.stop_after is None else min(args.stop_after, args.steps)
    progress = tqdm(range(num_steps), desc="train-draft", unit="step")
    for step in progress:
        scale = min(1.0, (step + 1) / warmup)
        scale *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in optimizer.param_groups:
            group["lr"] = args.lr * scale
        loss, agreement = loss_of_batch(next(batches))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        if step % 10 == 0 or step == num_steps - 1:
            history.append(
                {
                    "step": step,
                    "loss": round(loss.item(), 4),
                    "top1_agreement": [round(a, 4) for a in agreement],
                    "seconds": round(time.perf_counter() - started, 1),
                }
            )
            progress.set_postfix(loss=f"{loss.item():.3f}", top1=f"{agreement[0]:.3f}")
    return history


def _save(head: TrainableEagleHead, config: dict, out: Path) -> None:
    from safetensors.torch import save_file

    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(head.head_state_dict(), str(out / "model.safetensors"))


def measure_acceptance(
    target_dir, head_dir, files, tokenizer, num_prompts: int, serving=None, k: int = 4
):
    """Greedy decoding of held-out prompts with the head (``serving``: more of its
    speculative_config): per-position acceptance and the mean acceptance length (tokens per
    verify step, the bonus included)."""
    from octavo import LLM, SamplingParams

    texts = read_texts(files.held_out)[:num_prompts]
    if not texts:
        return None
    prompts = [{"prompt_token_ids": tokenizer(t)["input_ids"][:128]} for t in texts if t.strip()]
    spec = {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": k}
    spec.update(serving or {})
    llm = LLM(
        str(target_dir), speculative_config={**spec, "adaptive": False}, kv_cache_memory="256MiB"
    )
    llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False
    )
    stats = llm.engine.core.scheduler.spec_stats
    per_position = [round(n / stats.num_drafts, 4) for n in stats.num_accepted_tokens_per_pos]
    return {
        "k": k,
        "prompts": len(prompts),
        "acceptance_per_position": per_position,
        "mean_acceptance_length": round(1 + stats.num_accepted_tokens / stats.num_drafts, 3),
    }


def _plot(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history])
    ax.set_xlabel("step")
    ax.set_ylabel("loss (KL + 0.1 smooth-L1, weighted sum)")
    ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
