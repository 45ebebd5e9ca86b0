"""The test of the test: the conformance suite passes for cpu and fails when a kernel is wrong.

Each perturbation is a small kernel pack (a ``tryfirst`` plugin answering for ``cpu``) loaded
with ``--octavo-plugin``, exactly as a vendor's kernel pack would be checked. The suite runs
in-process through pytest's ``pytester``.
"""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

# A verifier that ignores its uniforms: every draft the target gives any probability is kept.
ACCEPT_EVERY_DRAFT = """
import torch
from octavo import hookimpl
from octavo_cpu.rejection_sampler import rejection_sample

def accept_every_draft(ids, counts, draft_probs, target_probs, temperature, uniforms, noise):
    no_uniforms = torch.zeros_like(uniforms)
    return rejection_sample(
        ids, counts, draft_probs, target_probs, temperature, no_uniforms, noise
    )

@hookimpl(tryfirst=True)
def octavo_rejection_sampler(platform):
    if platform.name == "cpu":
        return accept_every_draft
"""

# kind -> (suite module that must catch it, the plugin's source, the suite test that does)
PERTURBATIONS = {
    "attention": (
        "test_attention",
        """
import dataclasses
from octavo import hookimpl
from octavo_cpu.attention import CpuAttentionBackend

@hookimpl(tryfirst=True)
def octavo_attention_backend(platform, spec):
    # A scale off by 0.1%: only float32 budgets are tight enough to see it.
    if platform.name == "cpu":
        return CpuAttentionBackend(dataclasses.replace(spec, scale=spec.scale * 1.001))
""",
        "test_mixed_prefill_and_decode",
    ),
    "rms_norm": (
        "test_rms_norm",
        """
from octavo import hookimpl
from octavo_cpu.rms_norm import make_rms_norm

@hookimpl(tryfirst=True)
def octavo_rms_norm(platform, hidden_size, eps, dtype):
    # Ignores eps: invisible for unit-scale inputs, wrong for small ones.
    if platform.name == "cpu":
        return make_rms_norm(hidden_size, 0.0, dtype)
""",
        "test_eps_matters_for_small_inputs",
    ),
    "scaled_mm": (
        "test_scaled_mm",
        """
from octavo.ops import reference
from octavo.platform import hookimpl

def per_channel_as_per_tensor(a, b, scale_a, scale_b, out_dtype, bias=None):
    # Per-channel weight scales read as one per-tensor scale (the first channel's).
    return reference.scaled_mm(a, b, scale_a, scale_b.reshape(-1)[:1], out_dtype, bias)

@hookimpl(tryfirst=True)
def octavo_scaled_mm(platform):
    if platform.name == "cpu":
        return per_channel_as_per_tensor
""",
        "test_scaled_mm",
    ),
    "silu_and_mul": (
        "test_silu_and_mul",
        """
import torch
from octavo.platform import hookimpl

def sigmoid_and_mul(gate, up):
    # The gate's sigmoid without the gate itself: right sign, wrong size.
    return torch.sigmoid(gate) * up

@hookimpl(tryfirst=True)
def octavo_silu_and_mul(platform):
    if platform.name == "cpu":
        return sigmoid_and_mul
""",
        "test_silu_and_mul",
    ),
    "rotary_embedding": (
        "test_rotary_embedding",
        """
import torch
from octavo.platform import hookimpl

def rotate_pairs(cos_sin, query, key, head_dim):
    # GPT-J's interleaved pairs (x0, x1), (x2, x3)... instead of Llama's two halves.
    cos, sin = cos_sin
    def rotate(x):
        x = x.view(x.shape[0], -1, head_dim)
        pairs = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        return x * cos + pairs * sin
    return rotate(query), rotate(key)

@hookimpl(tryfirst=True)
def octavo_rotary_embedding(platform):
    if platform.name == "cpu":
        return rotate_pairs
""",
        "test_rotary_embedding",
    ),
    "sampler": (
        "test_sampler",
        """
import dataclasses
from octavo import hookimpl
from octavo_cpu.sampler import sample

def sample_one_too_many(logits, metadata):
    # top-k off by one: keeps k + 1 tokens.
    top_k = metadata.top_k + (metadata.top_k > 0).to(metadata.top_k.dtype)
    return sample(logits, dataclasses.replace(metadata, top_k=top_k))

@hookimpl(tryfirst=True)
def octavo_sampler(platform, vocab_size):
    if platform.name == "cpu":
        return sample_one_too_many
""",
        "test_random_rows_stay_in_the_allowed_set",
    ),
    "token_bitmask": (
        "test_token_bitmask",
        """
from octavo import hookimpl
from octavo_cpu.token_bitmask import torch_apply_token_bitmask

def ignore_indices(logits, bitmask, indices=None):
    torch_apply_token_bitmask(logits, bitmask)

@hookimpl(tryfirst=True)
def octavo_apply_token_bitmask(platform):
    if platform.name == "cpu":
        return ignore_indices
""",
        "test_bitmask_with_indices",
    ),
    "fused_moe": (
        "test_fused_moe",
        """
import dataclasses
from octavo.ops import reference
from octavo.platform import hookimpl

@hookimpl(tryfirst=True)
def octavo_fused_moe(platform, spec):
    # The chosen experts' weights never renormalised (right experts, wrong mix).
    if platform.name == "cpu":
        raw = dataclasses.replace(spec, renormalize=False)
        return lambda w13, w2: reference.pack_fused_moe(raw, w13, w2)
""",
        "test_fused_moe",
    ),
    "mla_attention": (
        "test_mla_attention",
        """
from octavo.ops.reference_mla import ReferenceMLABackend
from octavo.platform import hookimpl

class LatentOnly(ReferenceMLABackend):
    # Scores from the latent alone: the rotary key part (the positions) ignored.
    def forward(self, query, kv_row, kv_cache, metadata):
        latent = self.spec.kv_lora_rank
        query, kv_row = query.clone(), kv_row.clone()
        query[..., latent:] = 0
        return super().forward(query, kv_row, kv_cache, metadata)

@hookimpl(tryfirst=True)
def octavo_mla_attention_backend(platform, spec):
    if platform.name == "cpu":
        return LatentOnly(spec)
""",
        "test_mla_attention_matches_dense_attention",
    ),
    "rejection_sampler": (
        "test_rejection_sampler",
        ACCEPT_EVERY_DRAFT,
        "test_random_verification_matches_the_reference",
    ),
}


@pytest.fixture(scope="module", autouse=True)
def plugins_imported_once():
    """Import out here every plugin and whatever the suite imports lazily (torch.testing pulls
    in torch.distributed): pytester unloads modules first imported inside a run, and modules
    that register native operators (torch.distributed, triton, jax) break when imported twice
    in one process."""
    import torch

    from octavo.platform import Platform

    platform = Platform.select("cpu")
    platform.apply_token_bitmask()(torch.zeros(1, 32), torch.full((1, 1), -1, dtype=torch.int32))
    torch.testing.assert_close(torch.zeros(1), torch.zeros(1))


def run_suite(pytester: pytest.Pytester, target: str, *args: str) -> pytest.RunResult:
    return pytester.runpytest(
        "--pyargs",
        target,
        "--octavo-platform",
        "cpu",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rf",
        *args,
    )


@pytest.mark.parametrize("kind", sorted(PERTURBATIONS))
def test_suite_fails_for_a_perturbed_kernel(pytester: pytest.Pytester, kind: str):
    module, source, must_fail = PERTURBATIONS[kind]
    pytester.makepyfile(**{f"perturbed_{kind}": source})
    pytester.syspathinsert()
    # -x: the first failure is enough, and keeps this test quick.
    result = run_suite(
        pytester,
        f"octavo.testing.conformance.{module}",
        "-x",
        "--octavo-plugin",
        f"perturbed_{kind}",
    )
    assert result.parseoutcomes().get("failed", 0) == 1, result.stdout.str()
    result.stdout.fnmatch_lines([f"FAILED *::{must_fail}*"])


def test_distribution_check_catches_a_lossy_verifier(pytester: pytest.Pytester):
    """The statistical check alone (no comparison with the reference) sees a verifier that
    keeps drafts it should reject: its output follows the draft's distribution."""
    pytester.makepyfile(perturbed_rejection=ACCEPT_EVERY_DRAFT)
    pytester.syspathinsert()
    result = run_suite(
        pytester,
        "octavo.testing.conformance.test_rejection_sampler",
        "-k",
        "follow_the_target_distribution",
        "--octavo-plugin",
        "perturbed_rejection",
    )
    assert result.parseoutcomes().get("failed", 0) == 2, result.stdout.str()


@pytest.mark.slow
def test_suite_passes_for_cpu(pytester: pytest.Pytester):
    result = run_suite(pytester, "octavo.testing.conformance")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes.get("passed", 0) > 40, result.stdout.str()
