"""LoRA over a base whose linear layers stay quantized (a GGUF Q8_0 file multiplied by the
platform's kernel over its rows): the adapter's deltas apply there as on the dequantized
weights, in the activations' dtype (the layers' weights are raw rows)."""

from __future__ import annotations

import pytest

from octavo import LLM, LoRARequest, SamplingParams
from octavo.platform import Platform
from octavo.testing.tiny_gguf import write_gguf

NEXT_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)
PROMPTS = [[1] + [(37 * i + 11 * j) % 500 + 3 for j in range(5 + i % 7)] for i in range(16)]


def next_tokens(model, adapter, platform=None) -> list[int]:
    llm = LLM(str(model), enable_lora=True, max_lora_rank=16, kv_cache_memory="8MiB")
    lora = None if adapter is None else LoRARequest("a", 1, str(adapter))
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], NEXT_TOKEN, lora_request=lora, use_tqdm=False
    )
    runner = llm.engine.core.runner
    part = runner.lora.parts[0]["q_proj"]
    assert part.a.dtype == runner.model_config.dtype  # not the quantized rows' uint8
    return [o.outputs[0].token_ids[0] for o in outputs]


def test_lora_on_kept_quantized_layers_matches_the_dequantized(
    base_model, adapters, tmp_path, monkeypatch
):
    gguf = write_gguf(base_model, tmp_path / "tiny.Q8_0.gguf", "Q8_0")
    adapter = adapters["all-r16"]
    native = next_tokens(gguf, adapter)
    native_base = next_tokens(gguf, None)
    monkeypatch.setattr(Platform, "quantized_linear_packer", lambda self, quant_type: None)
    dequantized = next_tokens(gguf, adapter)
    agree = sum(a == b for a, b in zip(native, dequantized))
    changed = sum(a != b for a, b in zip(native, native_base))
    assert agree >= len(PROMPTS) * 3 // 4, (native, dequantized)
    assert changed >= len(PROMPTS) // 2, "the adapter should change most next tokens"


@pytest.fixture(autouse=True)
def _gguf_package():
    pytest.importorskip("gguf")
