"""The platform's Mixture-of-Experts layer (``Platform.fused_moe``) against the reference: the
routing (softmax or sigmoid scores, renormalised or not, DeepSeek-V3's grouped choice with a
correction bias and a scaling factor, DeepSeek-V2's groups scored by their best expert) and the
chosen experts' weighted sum. Optional for a platform: without its kernel the reference serves."""

from __future__ import annotations

import pytest
import torch

from octavo.ops import reference
from octavo.platform.types import MoESpec
from octavo.testing.conformance import tolerances

# (num_tokens, hidden, intermediate, experts, top_k): no tokens, one token (a decode), widths
# no vector width divides, every expert chosen by some token, a prefill-sized step.
SHAPES = ((0, 32, 16, 4, 2), (1, 64, 32, 8, 2), (7, 40, 24, 6, 3), (13, 64, 48, 4, 4))
LARGE = ((67, 256, 128, 16, 4),)
ROUTINGS = {
    "softmax": dict(scoring="softmax", renormalize=True),  # Mixtral, Qwen3-MoE
    "softmax-raw": dict(scoring="softmax", renormalize=False),  # Qwen3-MoE without norm_topk_prob
    "grouped": dict(  # DeepSeek-V3
        scoring="sigmoid",
        renormalize=True,
        num_expert_groups=2,
        topk_groups=1,
        routed_scaling_factor=2.5,
    ),
    "grouped-max": dict(  # DeepSeek-V2's group_limited_greedy: a group scored by its best expert
        scoring="softmax",
        renormalize=False,
        num_expert_groups=2,
        topk_groups=1,
        routed_scaling_factor=2.0,
        group_score="max",
    ),
}


def cases(quick: bool):
    shapes = SHAPES if quick else SHAPES + LARGE
    return [(shape, routing) for shape in shapes for routing in ROUTINGS]


@pytest.fixture(params=cases(quick=False), ids=lambda c: "t{}h{}i{}e{}k{}-{}".format(*c[0], c[1]))
def case(request, octavo_conformance_quick):
    if octavo_conformance_quick and request.param not in cases(quick=True):
        pytest.skip("--octavo-conformance-quick")
    return request.param


def make(case, dtype):
    (num_tokens, hidden, inner, experts, top_k), routing = case
    groups = ROUTINGS[routing].get("num_expert_groups", 1)
    top_k = min(top_k, experts // groups)  # the grouped choice picks from one group's experts
    spec = MoESpec(experts, top_k, hidden, inner, dtype, **ROUTINGS[routing])
    generator = torch.Generator().manual_seed(num_tokens * 31 + hidden + experts)
    x = torch.randn(num_tokens, hidden, generator=generator).to(dtype)
    logits = (torch.randn(num_tokens, experts, generator=generator) * 2).to(dtype)
    w13 = (torch.randn(experts, 2 * inner, hidden, generator=generator) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inner, generator=generator) / inner**0.5).to(dtype)
    bias = None
    if routing == "grouped":
        bias = torch.randn(experts, generator=generator) * 0.1
    return spec, x, logits, w13, w2, bias


@pytest.mark.parametrize("dtype", tolerances.ALL_DTYPES, ids=str)
def test_fused_moe(octavo_platform, octavo_device, dtype, case):
    """The layer's output in the model dtype; its inputs (and the packed weights' sources) are
    left as they were."""
    tolerances.require_dtype(octavo_platform, dtype)
    spec, x, logits, w13, w2, bias = make(case, dtype)
    expected = reference.fused_moe(x, logits, w13, w2, spec, bias)
    on = [t.clone().to(octavo_device) for t in (x, logits, w13, w2)]
    x_dev, logits_dev, w13_dev, w2_dev = on
    bias_dev = None if bias is None else bias.to(octavo_device)
    fn = octavo_platform.fused_moe(spec)(w13_dev, w2_dev)
    out = fn(x_dev, logits_dev, bias_dev)
    assert out.dtype == dtype and tuple(out.shape) == tuple(x.shape)
    tolerances.assert_close(out, expected, tolerances.FUSED_MOE[dtype], f"fused_moe {case}")
    for before, after in zip((x, logits, w13, w2), on):
        assert torch.equal(after.cpu(), before), "fused_moe changed its inputs"
    again = fn(x_dev, logits_dev, bias_dev)  # a second call of the same packed layer
    assert torch.equal(again.cpu(), out.cpu()), "the same call gave other numbers"


def test_the_reference_is_a_per_token_sum():
    """The reference's per-expert loop equals each token's own sum over its top-k experts with
    the routing written out (the oracle's oracle), grouped routing included."""
    for routing in ROUTINGS:
        spec, x, logits, w13, w2, bias = make(((9, 24, 10, 6, 2), routing), torch.float32)
        out = reference.fused_moe(x, logits, w13, w2, spec, bias)
        for t in range(x.shape[0]):
            scores = logits[t].softmax(-1) if spec.scoring == "softmax" else logits[t].sigmoid()
            choice = scores if bias is None else scores + bias
            if spec.num_expert_groups > 1:
                groups = choice.view(spec.num_expert_groups, -1)
                if spec.group_score == "max":
                    best = groups.max(dim=-1).values.argmax()
                else:
                    best = groups.topk(2, dim=-1).values.sum(-1).argmax()
                allowed = torch.zeros_like(groups, dtype=torch.bool).index_fill_(0, best, True)
                choice = choice.masked_fill(~allowed.view(-1), float("-inf"))
            chosen = choice.topk(spec.top_k).indices
            weights = scores[chosen] / (scores[chosen].sum() if spec.renormalize else 1)
            want = torch.zeros(x.shape[1])
            for weight, e in zip(weights * spec.routed_scaling_factor, chosen.tolist()):
                gate, up = (w13[e] @ x[t]).chunk(2)
                want += weight * (w2[e] @ (torch.nn.functional.silu(gate) * up))
            torch.testing.assert_close(out[t], want, atol=1e-5, rtol=1e-5)
