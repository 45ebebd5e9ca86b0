"""The model and a plain torch training loop: AdamW, linear warm-up, cosine decay.

Everything that decides the result is in :class:`TrainConfig`; with the same config, the same
interpreter (hence the same stdlib) and the same CPU thread count, a run is deterministic.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from demo_model.tokenizer import BOS, EOS, PAD


@dataclass(frozen=True)
class ModelShape:
    """Llama hyper-parameters of the demo model (about 4.2M parameters with a 4096 vocabulary)."""

    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 512


@dataclass(frozen=True)
class TrainConfig:
    """What a training run does; recorded in metrics.json."""

    vocab_size: int = 4096
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 1800
    peak_lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 60
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_windows: int = 16  # held-out windows scored at each eval point of the curve
    seed: int = 0
    shape: ModelShape = field(default_factory=ModelShape)


@dataclass
class TrainHistory:
    """Per-step training losses and periodic held-out losses, for the curve and the report."""

    train_loss: List[float] = field(default_factory=list)
    eval_steps: List[int] = field(default_factory=list)
    eval_loss: List[float] = field(default_factory=list)
    train_seconds: float = 0.0


def build_model(config: TrainConfig, token_ids: dict) -> LlamaForCausalLM:
    """A freshly initialised float32 Llama with tied embeddings, seeded by ``config.seed``."""
    shape = config.shape
    llama_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=token_ids[BOS],
        eos_token_id=token_ids[EOS],
        pad_token_id=token_ids[PAD],
        torch_dtype="float32",
    )
    torch.manual_seed(config.seed)
    return LlamaForCausalLM(llama_config).float()


def pack_windows(documents: Sequence[Sequence[int]], seq_len: int) -> torch.Tensor:
    """Concatenate the documents and cut the stream into ``[num_windows, seq_len]`` windows."""
    stream = torch.tensor([t for doc in documents for t in doc], dtype=torch.long)
    num_windows = stream.numel() // seq_len
    if num_windows == 0:
        raise ValueError(f"corpus has {stream.numel()} tokens, fewer than one window of {seq_len}")
    return stream[: num_windows * seq_len].view(num_windows, seq_len)


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warm-up to ``peak_lr``, then cosine decay to ``min_lr_ratio * peak_lr``."""
    if step < config.warmup_steps:
        return config.peak_lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return config.peak_lr * (config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine)


def batch_order(num_windows: int, config: TrainConfig) -> torch.Tensor:
    """Window indices for every step, ``[steps, batch_size]``: a fresh seeded shuffle per epoch."""
    generator = torch.Generator().manual_seed(config.seed)
    needed = config.steps * config.batch_size
    epochs = [
        torch.randperm(num_windows, generator=generator) for _ in range(-(-needed // num_windows))
    ]
    return torch.cat(epochs)[:needed].view(config.steps, config.batch_size)


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, windows: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token loss (nats/token) over ``windows``, every predicted token weighted
    equally."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size]
        loss = model(input_ids=batch, labels=batch).loss
        predicted = batch.shape[0] * (batch.shape[1] - 1)
        total, count = total + loss.item() * predicted, count + predicted
    model.train()
    return total / count


def _optimizer(model: LlamaForCausalLM, config: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.peak_lr, betas=(0.9, 0.95), eps=1e-8)


def train(
    model: LlamaForCausalLM,
    train_windows: torch.Tensor,
    eval_windows: torch.Tensor,
    config: TrainConfig,
    stop_after: Optional[int] = None,
) -> TrainHistory:
    """Train in place for ``config.steps`` steps; held-out loss every ``eval_every`` steps.

    ``stop_after`` ends the run early without changing the schedule, so a short run retraces the
    first steps of a full one exactly (a cheap reproducibility check).
    """
    history = TrainHistory()
    optimizer = _optimizer(model, config)
    order = batch_order(train_windows.shape[0], config)
    curve_windows = eval_windows[: config.eval_windows]
    model.train()
    start = time.perf_counter()
    num_steps = config.steps if stop_after is None else min(stop_after, config.steps)
    progress = tqdm(range(num_steps), desc="training", unit="step", dynamic_ncols=True)
    for step in progress:
        lr = learning_rate(step, config)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = train_windows[order[step]]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history.train_loss.append(loss.item())
        if (step + 1) % config.eval_every == 0 or step + 1 == num_steps:
            history.eval_steps.append(step + 1)
            history.eval_loss.append(evaluate(model, curve_windows))
        held_out = f"{history.eval_loss[-1]:.3f}" if history.eval_loss else "-"
        progress.set_postfix(
            loss=f"{history.train_loss[-1]:.3f}", held_out=held_out, lr=f"{lr:.1e}"
        )
    history.train_seconds = time.perf_counter() - start
    model.eval()
    return history
