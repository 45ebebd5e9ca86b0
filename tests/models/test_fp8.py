"""``--quantization fp8``: linear weights in e4m3 with per-channel scales, activations per token.

The cpu half runs in the cpu leg; the emulated-GPU half (the Triton ``scaled_mm`` under
``TRITON_INTERPRET=1``) runs in the cuda-interpret leg, which lists this file.
"""

from __future__ import annotations

import os

import pytest
import torch

from octavo.errors import ConfigError
from octavo.model_executor.loader import load_model
from octavo.model_executor.model_config import ModelConfig
from octavo.models.layers.fp8 import FP8_DTYPE, quantize_rows
from octavo.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from octavo.platform import AttentionMetadata, Platform
from octavo.testing.tiny_models import TinyModelSpec, write_tiny_model

SPEC = TinyModelSpec(
    hidden_size=64, num_hidden_layers=2, vocab_size=512, max_position_embeddings=128, seed=7
)
BLOCK_SIZE = 16


def emulated_platform() -> str | None:
    """The GPU platform this run emulates in the Triton interpreter (cuda-interpret leg)."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return None
    return os.environ.get("OCTAVO_TRITON_INTERPRET_DEVICE") or None


# The cpu-only cases run in the cpu leg; the emulated-GPU leg runs just the comparison.
cpu_only = pytest.mark.skipif(emulated_platform() is not None, reason="runs in the cpu leg")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("fp8") / "llama", SPEC)


def load(model_dir, quantization, platform_name="cpu"):
    platform = Platform.select(device=platform_name)
    config = ModelConfig.from_folder(model_dir, dtype="float32")
    model = load_model(
        config, platform, block_size=BLOCK_SIZE, device="cpu", quantization=quantization
    )
    return model, platform


def prefill_logits(model, prompt: list[int]) -> torch.Tensor:
    """Logits at every position of one prompt, prefilled in one step."""
    n = len(prompt)
    blocks = -(-n // BLOCK_SIZE)
    for layer in model.modules():
        if hasattr(layer, "backend") and hasattr(layer, "kv_cache"):
            layer.kv_cache = torch.zeros(layer.backend.kv_cache_shape(blocks), dtype=torch.float32)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_table=torch.arange(blocks, dtype=torch.int32).view(1, -1),
        slot_mapping=torch.arange(n, dtype=torch.int64),
        max_query_len=n,
        max_seq_len=n,
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt), torch.arange(n), metadata)
        return model.compute_logits(hidden).float()


@cpu_only
def test_quantize_rows_round_trips_within_fp8_precision():
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(0)) * torch.tensor(
        [[1e-3], [1], [30], [0], [5]]
    )
    q, scale = quantize_rows(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (5, 1)
    assert torch.equal(
        q.float().abs().amax(1)[[0, 1, 2, 4]], torch.full((4,), 448.0)
    )  # rows use the full range
    torch.testing.assert_close(q.float() * scale, x, atol=0, rtol=2**-3)  # e4m3: 3 mantissa bits


@cpu_only
def test_only_decoder_linear_weights_are_quantised(model_dir):
    model, _ = load(model_dir, "fp8")
    linear = [
        m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
    ]
    assert len(linear) == 4 * SPEC.num_hidden_layers  # qkv, o, gate_up, down per layer
    for layer in linear:
        assert layer.weight.dtype == FP8_DTYPE
        assert (
            layer.weight_scale.shape == (layer.weight.shape[0],)
            and layer.weight_scale.dtype == torch.float32
        )
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.float32


@cpu_only
def test_fp8_logits_are_close_to_the_unquantised_ones(model_dir):
    """Loose enough for e4m3's 3 mantissa bits (about 3.5% error per product here, 10% after
    the eight products and two attentions of this model), tight enough that a wrong scale fails:
    scales 10% too large give 39%; a missing or transposed one is off by far more."""
    prompt = [1] + [(37 * j) % 500 + 3 for j in range(20)]
    exact = prefill_logits(load(model_dir, None)[0], prompt)
    fp8 = prefill_logits(load(model_dir, "fp8")[0], prompt)
    assert not torch.equal(fp8, exact)
    error = ((fp8 - exact).norm() / exact.norm()).item()
    assert error < 0.2, f"fp8 logits are off by {error:.3f} (relative RMS)"


@cpu_only
def test_an_unsupported_quantization_names_the_supported_ones(model_dir):
    with pytest.raises(ValueError, match="'int4' is not supported; supported: fp8"):
        load(model_dir, "int4")


@cpu_only
def test_a_platform_without_fp8_refuses_it(model_dir, monkeypatch):
    import dataclasses

    platform = Platform.select(device="cpu")
    monkeypatch.setattr(
        platform, "capabilities", dataclasses.replace(platform.capabilities, supports_fp8=False)
    )
    config = ModelConfig.from_folder(model_dir, dtype="float32")
    with pytest.raises(ConfigError, match="has no FP8 kernels"):
        load_model(config, platform, block_size=BLOCK_SIZE, device="cpu", quantization="fp8")


@pytest.mark.slow
@pytest.mark.skipif(
    emulated_platform() is None, reason="needs TRITON_INTERPRET=1 (the cuda-interpret leg)"
)
def test_fp8_greedy_tokens_match_the_cpu_platform(model_dir):
    """``quantization="fp8"`` on the emulated GPU platform (Triton scaled_mm) generates the
    cpu platform's (reference scaled_mm) greedy tokens."""
    from octavo import LLM, SamplingParams

    name = emulated_platform()
    prompts = [
        [1] + [(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((13, 4, 9))
    ]
    params = SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True
    )  # the interpreter is slow

    def generate(device: str) -> list[list[int]]:
        llm = LLM(
            str(model_dir),
            device=device,
            quantization="fp8",
            dtype="float32",
            kv_cache_memory="2MiB",
            max_num_seqs=4,
            max_num_batched_tokens=32,
        )
        assert llm.engine.core.platform.name == device
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    expected = generate("cpu")
    assert generate(name) == expected


def test_engine_args_refuse_an_unsupported_quantization_before_loading_anything():
    from octavo.config import EngineArgs

    with pytest.raises(ConfigError, match="quantization 'awq' is not supported; supported: fp8"):
        EngineArgs(model="m", quantization="awq")
    assert EngineArgs(model="m", quantization="fp8").quantization == "fp8"
