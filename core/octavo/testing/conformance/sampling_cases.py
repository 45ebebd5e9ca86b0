"""Sampler inputs with unambiguous answers.

top-k, top-p and min-p each keep a prefix of a row's tokens sorted by probability, so the
tokens a row may produce are its ``n`` most likely ones for some ``n``. Rows here are described
by how many tokens each filter should keep, and the thresholds are placed halfway between two
neighbouring tokens' values, so every correct implementation (sorting or not, float32 or not)
agrees on the allowed set.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from octavo.platform.types import SamplingMetadata


@dataclasses.dataclass(frozen=True)
class RowSpec:
    """How one row samples: temperature and how many tokens each filter keeps (0 = filter off)."""

    temperature: float
    keep_top_k: int = 0
    keep_top_p: int = 0
    keep_min_p: int = 0


@dataclasses.dataclass(frozen=True)
class RowParams:
    """A row's sampling parameters and the number of most likely tokens it may produce."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    num_allowed: int


def make_metadata(
    params: Sequence[RowParams],
    device: torch.device,
    generators: Optional[dict[int, torch.Generator]] = None,
) -> SamplingMetadata:
    """SamplingMetadata for ``params`` with the skip flags set from the values."""
    temperature = [p.temperature for p in params]
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    return SamplingMetadata(
        temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
        top_k=torch.tensor(top_k, dtype=torch.int32, device=device),
        top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
        min_p=torch.tensor(min_p, dtype=torch.float32, device=device),
        generators=dict(generators or {}),
        all_greedy=all(t == 0 for t in temperature),
        all_random=all(t > 0 for t in temperature),
        no_top_k=all(k == 0 for k in top_k),
        no_top_p=all(p >= 1.0 for p in top_p),
        no_min_p=all(p == 0.0 for p in min_p),
    )


def row_params(logits: torch.Tensor, spec: RowSpec) -> RowParams:
    """Thresholds for one row of ``logits [V]`` that keep exactly the counts ``spec`` asks for."""
    vocab = logits.shape[-1]
    if spec.temperature == 0:
        return RowParams(0.0, 0, 1.0, 0.0, 1)
    probs = (logits.double() / spec.temperature).softmax(-1).sort(descending=True).values
    allowed = vocab
    top_k = 0
    if spec.keep_top_k:
        top_k = spec.keep_top_k
        allowed = top_k
    top_p = 1.0
    if spec.keep_top_p:
        # top-p sees the top-k survivors renormalised; token i is kept while the mass before it
        # is below p, so p between cum[n-2] and cum[n-1] keeps n tokens.
        n = spec.keep_top_p
        assert n <= allowed, "top-p must keep fewer tokens than top-k leaves"
        cum = (probs[:allowed] / probs[:allowed].sum()).cumsum(0)
        low = cum[n - 2].item() if n >= 2 else 0.0
        top_p = (low + cum[n - 1].item()) / 2
        allowed = n
    min_p = 0.0
    if spec.keep_min_p:
        n = spec.keep_min_p
        assert n < allowed, "min-p must keep fewer tokens than the other filters leave"
        ratio = probs / probs[0]
        min_p = (ratio[n - 1].item() + ratio[n].item()) / 2
        allowed = n
    return RowParams(spec.temperature, top_k, top_p, min_p, allowed)


def allowed_tokens(logits: torch.Tensor, num_allowed: int) -> set[int]:
    """The ``num_allowed`` most likely token ids of one row."""
    return set(logits.topk(num_allowed).indices.tolist())


def expected_probs(logits: torch.Tensor, params: RowParams) -> torch.Tensor:
    """The distribution a row must sample from: softmax at temperature over the allowed tokens."""
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep[logits.topk(params.num_allowed).indices] = True
    scaled = (logits.double() / params.temperature).masked_fill(~keep, float("-inf"))
    return scaled.softmax(-1)
