"""bfloat16 models with linear layers widened to float32 (hosts without native bfloat16 matmul):
the same numbers as a bfloat16 matmul, the same greedy tokens as transformers, and only the
linear layers change dtype."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from test_greedy import assert_bfloat16_greedy_matches

from octavo.model_executor.batch_runner import RunnerConfig
from octavo.model_executor.model_config import ModelConfig
from octavo.model_executor.model_runner import ModelRunner
from octavo.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from octavo.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from octavo.models.layers.norm import RMSNorm
from octavo.models.layers.packed import PackedMatmul
from octavo.models.layers.widen import WidenedMatmul, widen_matmuls


def test_widened_product_equals_the_bfloat16_matmul_within_one_rounding():
    """Both sum exact products in float32 and round once, so they differ by at most one bfloat16
    ulp (summation order); a product that skipped the rounding or the widening would not."""
    torch.manual_seed(0)
    layer = ColumnParallelLinear(96, [80], bias=True, dtype=torch.bfloat16, device="cpu")
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(33, 96, dtype=torch.bfloat16)
    native = F.linear(x, layer.weight, layer.bias)
    model = torch.nn.Sequential(layer, ParallelLMHead(8, 80, dtype=torch.bfloat16, device="cpu"))
    widen_matmuls(model, (torch.bfloat16,))
    assert isinstance(layer.quant_method, WidenedMatmul) and layer.weight.dtype == torch.float32
    widened = layer(x)
    assert widened.dtype == torch.bfloat16
    ulp = native.float().abs().clamp(min=1e-30).log2().floor().sub(7).exp2()
    assert ((widened.float() - native.float()).abs() <= ulp).all()
    assert (widened != native).float().mean() < 0.05  # mostly bit-identical


def widening_platform(platform, dtypes):
    """The selected platform as a host that widens ``dtypes`` (whatever this CPU has)."""
    clone = copy.copy(platform)
    clone.capabilities = dataclasses.replace(platform.capabilities, widened_matmul_dtypes=dtypes)
    return clone


def runner_for(path, platform, dtype):
    config = ModelConfig.from_folder(
        path,
        dtype=dtype,
        supported_dtypes=platform.capabilities.dtypes,
        platform_name=platform.name,
    )
    return ModelRunner(config, platform, RunnerConfig(16, 8, 512))


def test_only_linear_layers_and_the_head_product_are_widened(tiny_models, octavo_platform):
    path = tiny_models["LlamaForCausalLM"]
    runner = runner_for(path, widening_platform(octavo_platform, (torch.bfloat16,)), "bfloat16")
    modules = list(runner.model.modules())
    linears = [m for m in modules if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert linears and all(m.weight.dtype == torch.float32 for m in linears)
    # widened, and then perhaps packed by the platform's GEMM (packed.py keeps the arithmetic)
    assert all(
        isinstance(m.quant_method, WidenedMatmul)
        or (isinstance(m.quant_method, PackedMatmul) and m.quant_method.widened)
        for m in linears
    )
    embedding = next(m for m in modules if type(m) is VocabParallelEmbedding)
    head = next(m for m in modules if isinstance(m, ParallelLMHead))
    assert embedding.weight.dtype == torch.bfloat16 and head.widened_weight.dtype == torch.float32
    assert all(m.weight.dtype == torch.bfloat16 for m in modules if isinstance(m, RMSNorm))
    native = runner_for(path, octavo_platform, "bfloat16")
    assert runner.kv_cache_bytes_per_block() == native.kv_cache_bytes_per_block()
    hidden = torch.randn(3, head.embedding_dim, dtype=torch.bfloat16)
    assert head(hidden).dtype == torch.bfloat16

    float32_runner = runner_for(
        path, widening_platform(octavo_platform, (torch.bfloat16,)), "float32"
    )
    assert all(  # float32 is not widened (the platform may still pack it: see packed.py)
        not isinstance(m.quant_method, WidenedMatmul)
        and not getattr(m.quant_method, "widened", False)
        for m in float32_runner.model.modules()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
    )


@pytest.mark.parametrize("widened", [(torch.bfloat16,), ()], ids=["widened", "native"])
def test_bfloat16_greedy_tokens_match_transformers_either_way(
    widened, tiny_models, octavo_platform, oracle
):
    """As test_greedy's bfloat16 check (ties between the top two tokens excepted), for both
    paths."""
    path = tiny_models["LlamaForCausalLM"]
    runner = runner_for(path, widening_platform(octavo_platform, widened), "bfloat16")
    assert_bfloat16_greedy_matches(runner, path, oracle)
