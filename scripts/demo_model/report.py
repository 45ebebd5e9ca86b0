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
# One sampled completion besides the greedy ones: plain temperature sampling (no top-k/top-p),
# seeded so the README is reproducible.
SAMPLED_PROMPT = "def fibonacci(n):"
# Greedy decoding of a model this small soon repeats itself; vLLM's (and transformers')
# repetition_penalty, which octavo applies too, is the usual remedy. The README shows both.
REPETITION_PENALTY = 1.1
SAMPLED_TEMPERATURE = 0.8
SAMPLED_SEED = 0


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
def greedy_samples(
    model, tokenizer, prompts: Sequence[str] = SAMPLE_PROMPTS, repetition_penalty: float = 1.0
) -> Dict[str, str]:
    """Greedy completion of each prompt (the text generated after it)."""
    samples = {}
    for prompt in prompts:
        inputs = tokenizer(prompt, return_tensors="pt")
        output = model.generate(
            **inputs,
            do_sample=False,
            max_new_tokens=SAMPLE_NEW_TOKENS,
            pad_token_id=tokenizer.pad_token_id,
            repetition_penalty=repetition_penalty,
        )
        new_tokens = output[0, inputs["input_ids"].shape[1] :]
        samples[prompt] = tokenizer.decode(new_tokens, skip_special_tokens=True)
    return samples


@torch.no_grad()
def sampled_sample(model, tokenizer, prompt: str = SAMPLED_PROMPT) -> Dict[str, object]:
    """One completion sampled at SAMPLED_TEMPERATURE from a seeded generator, with its settings."""
    inputs = tokenizer(prompt, return_tensors="pt")
    torch.manual_seed(SAMPLED_SEED)
    output = model.generate(
        **inputs,
        do_sample=True,
        temperature=SAMPLED_TEMPERATURE,
        top_k=0,
        top_p=1.0,
        max_new_tokens=SAMPLE_NEW_TOKENS,
        pad_token_id=tokenizer.pad_token_id,
    )
    completion = tokenizer.decode(
        output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True
    )
    return {
        "prompt": prompt,
        "temperature": SAMPLED_TEMPERATURE,
        "seed": SAMPLED_SEED,
        "completion": completion,
    }


def write_metrics(metrics: dict, path: Path) -> None:
    """metrics.json, pretty-printed with sorted keys so re-runs diff cleanly."""
    path.write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _sample_block(prompt: str, completion: str, how: str = "greedy") -> str:
    return (
        f"Prompt `{prompt!r}`, {how}, {SAMPLE_NEW_TOKENS} new tokens:\n\n"
        f"```python\n{prompt}{completion}\n```\n"
    )


def _sampled_block(sampled: dict) -> str:
    how = (
        f"sampled at temperature {sampled['temperature']} "
        f"(`torch.manual_seed({sampled['seed']})`, no top-k/top-p)"
    )
    return _sample_block(sampled["prompt"], sampled["completion"], how)


def _reproduced(metrics: dict) -> str:
    """The re-run check, when one was recorded in metrics.json under "reproduced"."""
    check = metrics.get("reproduced")
    if not check:
        return ""
    step = check["step"]
    committed = metrics["curve"]["held_out_loss_first_windows"][
        metrics["curve"]["eval_steps"].index(step)
    ]
    full = step == metrics["config"]["steps"]
    run = "a full re-run" if full else f"a re-run of the same schedule stopped after {step} steps"
    return f"""

Checked on {check["date"]}: {run},
`{check["command"]}`, gave a held-out loss (first {metrics["config"]["eval_windows"]} windows) of
{check["held_out_loss_first_windows"]:.6f} at step {step}, against {committed:.6f} in this run's \
curve
({check["note"]}).{"" if full else " A full re-run takes as long as the time above."}"""


def _long_context(metrics: dict) -> str:
    """The held-out loss in windows of the full context, when recorded under
    "held_out_loss_full_context"."""
    loss = metrics.get("held_out_loss_full_context")
    if loss is None:
        return ""
    return (
        f" Scored in windows of {metrics['config']['shape']['max_position_embeddings']} tokens"
        f" the held-out loss is {loss:.4f} nats/token."
    )


def _steps_run(metrics: dict) -> str:
    steps, run = metrics["config"]["steps"], metrics.get("steps_run", metrics["config"]["steps"])
    return str(steps) if run == steps else f"{run} (stopped early) of a {steps}-step schedule:"


def render_readme(metrics: dict) -> str:
    """The model card: what the model is, how it was trained, and how good it is."""
    config, corpus = metrics["config"], metrics["corpus"]
    shape = config["shape"]
    blocks = [_sample_block(p, c) for p, c in metrics["samples"].items()]
    penalized = metrics.get("samples_repetition_penalty", {})
    how = f"greedy with `repetition_penalty={metrics.get('repetition_penalty')}`"
    blocks += [_sample_block(p, c, how) for p, c in penalized.items()]
    if "sampled" in metrics:
        blocks.append(_sampled_block(metrics["sampled"]))
    samples = "\n".join(blocks)
    minutes = metrics["total_seconds"] / 60
    threads = metrics.get("threads", 1)  # runs before --threads existed used one
    cpu_threads = f"{threads} CPU thread" + ("s" if threads > 1 else "")
    return f"""# octavo demo model

A {metrics["parameters"] / 1e6:.2f}M-parameter Llama trained from scratch on the source code \
(with its
docstrings) of the CPython {metrics["python"]} standard library, so that `make serve` has a real
model on a machine that cannot reach a model hub. It completes Python code; it knows nothing else.
Its chat template (ChatML-style markers) exists so that `/v1/chat/completions` works; the model was
never trained on conversations.

| | |
|---|---|
| architecture | `LlamaForCausalLM`: hidden {shape["hidden_size"]}, \
{shape["num_hidden_layers"]} layers, {shape["num_attention_heads"]} heads, \
{shape["num_key_value_heads"]} KV heads, MLP {shape["intermediate_size"]}, tied embeddings, \
context {shape["max_position_embeddings"]} |
| parameters | {metrics["parameters"]:,} (float32, `model.safetensors` \
{metrics["model_bytes"] / 2**20:.1f} MiB) |
| tokenizer | byte-level BPE, vocabulary {config["vocab_size"]}, trained by the same script; \
specials `<\\|pad\\|>` 0, `<\\|bos\\|>` 1, `<\\|eos\\|>` 2, `<\\|im_start\\|>` 3, \
`<\\|im_end\\|>` 4; \
BOS is prepended on encode |
| data | {corpus["train_files"]} stdlib files, {corpus["train_tokens"]:,} tokens (tests, \
`site-packages`, `encodings`, `pydoc_data` excluded); each file is \
`<\\|bos\\|> source <\\|eos\\|>` |
| held-out set | {corpus["held_out_files"]} files ({corpus["held_out_tokens"]:,} tokens), \
chosen by a hash of their path, never trained on |
| training | {_steps_run(metrics)} steps of {config["batch_size"]} x {config["seq_len"]} tokens \
({metrics["tokens_seen"]:,} tokens, {metrics["epochs"]:.2f} epochs); AdamW (0.9, 0.95), \
weight decay {config["weight_decay"]}, peak LR {config["peak_lr"]}, \
{config["warmup_steps"]} warm-up steps, cosine to {config["min_lr_ratio"]} x peak, \
gradient clip {config["grad_clip"]}; seed {config["seed"]} |
| **held-out loss** | **{metrics["held_out_loss"]:.4f} nats/token** \
(perplexity {metrics["held_out_perplexity"]:.2f}) over all held-out tokens, \
in windows of {config["seq_len"]} |
| final train loss | {metrics["final_train_loss"]:.4f} (mean of the last 50 steps) |
| time | {minutes:.1f} min wall in all ({metrics["train_seconds"] / 60:.1f} min of it training), \
{cpu_threads} ({metrics["cpu"]}) |
| software | Python {metrics["python"]}, torch {metrics["torch"]}, \
transformers {metrics["transformers"]}, tokenizers {metrics["tokenizers"]} |

![loss curve](loss_curve.png)

## How it was trained

From the repository root, with the project's virtualenv:

```
{metrics["command"]}
```

The script is seeded and deterministic: sorted file lists, a path-hash held-out split, a seeded
shuffle of training windows, `torch.set_num_threads({threads})` (`--threads`). \
Re-running it with the same command on
the same interpreter reproduces the held-out loss above within a few percent (bit-for-bit on the
same CPU and library versions; other CPUs, thread counts or versions change floating-point
rounding, and a different Python version has a different standard library to train on).
metrics.json records every setting and number of this run.{_reproduced(metrics)}

## What to expect

This model exists to exercise the engine (tokenization, batching, the paged KV cache, sampling,
streaming, chat templates) with real, non-random weights on any machine. It was sized to train in
about an hour on {cpu_threads} and has seen {metrics["tokens_seen"]:,} tokens \
({metrics["epochs"]:.2f} epochs of its
data), so it writes Python-looking text (imports, classes, docstrings, `if`/`return`/`self.`
statements, names from the standard library), not working programs, and it does not stay on topic:
`def fibonacci(n):` gets a docstring and a body that have nothing to do with Fibonacci numbers.
Plain greedy decoding soon repeats itself (a phrase, an argument name), as the first samples show;
`repetition_penalty={metrics.get("repetition_penalty")}` (vLLM's request field, applied by octavo
and by transformers alike) keeps greedy output on Python-looking lines, and sampling at a
temperature around 0.7-1.0 gives varied lines with made-up names (the last sample).
It was trained on {config["seq_len"]}-token windows: prompts plus completions up to its context of
{shape["max_position_embeddings"]} tokens work (RoPE), \
but predictions past position {config["seq_len"]} are weaker.{_long_context(metrics)}

## Draft head

`../demo-model-eagle` is an EAGLE head trained for this model with `octavo train-draft` (its
README has the command, the loss and the held-out acceptance: 3.22 tokens per verify step at
K = 4). Serve with it (`HEAD` that folder):

```
octavo serve --speculative-config \\
  '{{"method": "eagle", "model": "HEAD", "num_speculative_tokens": 4}}'
```

## Sample completions

{samples}"""
