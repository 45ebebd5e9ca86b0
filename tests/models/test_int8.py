"""``--quantization int8``: the decoder's linear weights kept as per-output-channel int8 rows and
multiplied by the platform's kernel; the next token agrees with the float model's on most prompts,
and a platform without the kernel refuses the flag."""

from __future__ import annotations

import pytest
import torch
from model_cases import TINY_SPECS, make_prompts
from test_greedy import run_greedy

from octavo.errors import ConfigError
from octavo.model_executor.batch_runner import RunnerConfig
from octavo.model_executor.model_config import ModelConfig
from octavo.model_executor.model_runner import ModelRunner
from octavo.quantization.quantized_linear import QuantizedMatmul, int8_rows

PROMPTS = make_prompts((1, 5, 9, 14, 19, 26, 33, 40), 512, seed=5)


def int8_runner(path, platform):
    config = ModelConfig.from_folder(path, dtype="float32")
    return ModelRunner(config, platform, RunnerConfig(16, 8, 512, quantization="int8"))


def test_int8_rows_round_trip():
    weight = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    weight[2] = 0.0  # an all-zero row keeps a usable scale
    raw = int8_rows(weight)
    values = raw[:, :64].view(torch.int8).float()
    scale = raw[:, 64:].contiguous().view(torch.float32)
    assert raw.shape == (5, 68) and values.abs().max() == 127
    assert torch.all((values * scale - weight).abs() <= scale / 2 + 1e-7)


@pytest.mark.parametrize("arch", ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"))
def test_int8_greedy_agrees_with_float(arch, tiny_models, make_runner, octavo_platform):
    if octavo_platform.quantized_linear_packer("int8") is None:
        pytest.skip(f"platform {octavo_platform.name!r} has no int8 kernel here")
    runner = int8_runner(tiny_models[arch], octavo_platform)
    methods = [m.quant_method for m in runner.model.modules() if hasattr(m, "quant_method")]
    assert methods and all(isinstance(q, QuantizedMatmul) for q in methods)
    quantized = run_greedy(runner, PROMPTS, 1)  # the next token: see test_gguf.py
    expected = run_greedy(make_runner(tiny_models[arch]), PROMPTS, 1)
    agree = sum(a == b for a, b in zip(quantized, expected))
    assert agree >= len(PROMPTS) * 3 // 4, (agree, TINY_SPECS[arch])


def test_int8_without_a_kernel_is_refused(tiny_models, octavo_platform, monkeypatch):
    monkeypatch.setattr(octavo_platform, "quantized_linear_packer", lambda quant_type: None)
    with pytest.raises(ConfigError, match="no int8 weight kernel here, so --quantization int8"):
        int8_runner(tiny_models["LlamaForCausalLM"], octavo_platform)
