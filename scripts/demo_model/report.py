"""What a training run leaves beside the weights: loss curve, metrics.json, samples, README.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Sequence

import matplotlib

matplotlib.use("Agg")  # headless: the figure only goes to a file
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from demo_model.training import TrainHistory  # noqa: E402

SAMPLE_PROMPTS = ("def fibonacci(n):", "import os\n")
SAMPLE_NEW_TOKENS = 64


def plot_loss_curve(history: TrainHistory, tokens_per_step: int, path: Path) -> None:
    """Training loss (raw and 50-step mean) and held-out loss against steps, saved as a PNG."""
    steps = torch.arange(1, len(history.train_loss) + 1)
    losses = torch.tensor(history.train_loss)
    window = min(50, len(losses))
    smoothed = losses.unfold(0, window, 1).mean(dim=1)
    figure, axes = plt.subplots(figsize=(7, 4.2), dpi=100)
    axes.plot(steps, losses, color="tab:blue", alpha=0.25, linewidth=0.8, label="train (per step)")
    axes.plot(steps[window - 1 :], smoothed, color="tab:blue", label=f"train ({window}-step mean)")
    axes.plot(history.eval_steps, history.eval_loss, "o-", color="tab:orange", label="held-out")
    axes.set_xlabel(f"step ({tokens_per_step} tokens each)")
    axes.set_ylabel("loss (nats/token)")
    axes.set_title("octavo demo model on the CPython stdlib")
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


@torch.no_grad()
def greedy_samples(model, tokenizer, prompts: Sequence[str] = SAMPLE_PROMPTS) -> Dict[str, str]:
    """Greedy completion of each prompt (the text generated after it)."""
    samples = {}
    for prompt in prompts:
        inputs = tokenizer(prompt, return_tensors="pt")
        output = model.generate(
            **inputs, do_sample=False, max_new_tokens=SAMPLE_NEW_TOKENS, pad_token_id=tokenizer.pad_token_id
        )
        new_tokens = output[0, inputs["input_ids"].shape[1] :]
        samples[prompt] = tokenizer.decode(new_tokens, skip_special_tokens=True)
    return samples


def write_metrics(metrics: dict, path: Path) -> None:
    """metrics.json, pretty-printed with sorted keys so re-runs diff cleanly."""
    path.write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _sample_block(prompt: str, completion: str) -> str:
    return f"Prompt `{prompt!r}`, greedy, {SAMPLE_NEW_TOKENS} new tokens:\n\n```python\n{prompt}{completion}\n```\n"


def _steps_run(metrics: dict) -> str:
    steps, run = metrics["config"]["steps"], metrics.get("steps_run", metrics["config"]["steps"])
    return str(steps) if run == steps else f"{run} (stopped early) of a {steps}-step schedule:"


def render_readme(metrics: dict) -> str:
    """The model card: what the model is, how it was trained, and how good it is."""
    config, corpus = metrics["config"], metrics["corpus"]
    shape = config["shape"]
    samples = "\n".join(_sample_block(p, c) for p, c in metrics["samples"].items())
    minutes = metrics["total_seconds"] / 60
    return f"""# octavo demo model

A {metrics['parameters'] / 1e6:.2f}M-parameter Llama trained from scratch on the source code (with its
docstrings) of the CPython {metrics['python']} standard library, so that `make serve` has a real
model on a machine that cannot reach a model hub. It completes Python code; it knows nothing else.
Its chat template (ChatML-style markers) exists so that `/v1/chat/completions` works; the model was
never trained on conversations.

| | |
|---|---|
| architecture | `LlamaForCausalLM`: hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, {shape['num_attention_heads']} heads, {shape['num_key_value_heads']} KV heads, MLP {shape['intermediate_size']}, tied embeddings, context {shape['max_position_embeddings']} |
| parameters | {metrics['parameters']:,} (float32, `model.safetensors` {metrics['model_bytes'] / 2**20:.1f} MiB) |
| tokenizer | byte-level BPE, vocabulary {config['vocab_size']}, trained by the same script; specials `<\\|pad\\|>` 0, `<\\|bos\\|>` 1, `<\\|eos\\|>` 2, `<\\|im_start\\|>` 3, `<\\|im_end\\|>` 4; BOS is prepended on encode |
| data | {corpus['train_files']} stdlib files, {corpus['train_tokens']:,} tokens (tests, `site-packages`, `encodings`, `pydoc_data` excluded); each file is `<\\|bos\\|> source <\\|eos\\|>` |
| held-out set | {corpus['held_out_files']} files ({corpus['held_out_tokens']:,} tokens), chosen by a hash of their path, never trained on |
| training | {_steps_run(metrics)} steps of {config['batch_size']} x {config['seq_len']} tokens ({metrics['tokens_seen']:,} tokens, {metrics['epochs']:.2f} epochs); AdamW (0.9, 0.95), weight decay {config['weight_decay']}, peak LR {config['peak_lr']}, {config['warmup_steps']} warm-up steps, cosine to {config['min_lr_ratio']} x peak, gradient clip {config['grad_clip']}; seed {config['seed']} |
| **held-out loss** | **{metrics['held_out_loss']:.4f} nats/token** (perplexity {metrics['held_out_perplexity']:.2f}) over all held-out tokens |
| final train loss | {metrics['final_train_loss']:.4f} (mean of the last 50 steps) |
| time | {minutes:.1f} min wall in all ({metrics['train_seconds'] / 60:.1f} min of it training), 1 CPU thread ({metrics['cpu']}) |
| software | Python {metrics['python']}, torch {metrics['torch']}, transformers {metrics['transformers']}, tokenizers {metrics['tokenizers']} |

![loss curve](loss_curve.png)

## How it was trained

From the repository root, with the project's virtualenv:

```
{metrics['command']}
```

The script is seeded and deterministic: sorted file lists, a path-hash held-out split, a seeded
shuffle of training windows, `torch.set_num_threads(1)`. Re-running it with the same command on
the same interpreter reproduces the held-out loss above within a few percent (bit-for-bit on the
same CPU and library versions; other CPUs, thread counts or versions change floating-point
rounding, and a different Python version has a different standard library to train on).
metrics.json records every setting and number of this run.

## What to expect

This model exists to exercise the engine (tokenization, batching, the paged KV cache, sampling,
streaming, chat templates) with real, non-random weights on any machine. It was sized to train in
well under an hour on one CPU thread and has seen {metrics['tokens_seen']:,} tokens, so it writes
Python-looking text (keywords, indentation, names from the standard library), not working
programs, and greedy decoding soon falls into repeating a line, as the samples show. Sampling with
a temperature around 0.7-1.0 gives more varied text.

## Sample completions

{samples}"""
