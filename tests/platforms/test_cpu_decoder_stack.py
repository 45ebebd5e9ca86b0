"""The cpu platform's decoder stack (one compiled call for Llama-family decoder layers and their
final norm): the same hidden states as the modules, bit for bit, in every step of mixed
batches, for Llama, Mistral, Qwen2 (q/k/v biases) and Qwen3 (q/k norms), in float32 and
bfloat16, over float and quantized (GGUF) weights, and for an EAGLE head; the modules wherever
it does not apply."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.testing.tiny_models import TinyModelSpec, write_random_eagle_head, write_tiny_model
from octavo_cpu import kernels, plugin
from octavo_cpu.decoder_stack import STACK_ENV, DecoderStack
from octavo_cpu.gemm import GEMM_ENV

pytestmark = pytest.mark.skipif(
    kernels.load_kernels().ops is None, reason="the compiled kernels do not run here"
)

SPECS = {
    "llama-gqa": TinyModelSpec(),
    "llama-head-dim-8": TinyModelSpec(hidden_size=32, num_attention_heads=4, head_dim=8),
    "mistral-window-6": TinyModelSpec(architecture="MistralForCausalLM", sliding_window=6),
    "qwen2-biases": TinyModelSpec(architecture="Qwen2ForCausalLM", seed=2),
    "qwen3-qk-norms": TinyModelSpec(architecture="Qwen3ForCausalLM", head_dim=32, seed=3),
}
# Prompts of 37, 5, 21 and 2 tokens, 24 tokens a step: prefill chunks mixed with decodes.
PROMPTS = [
    [1] + [(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((36, 4, 20, 1))
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def make_llm(folder, **engine_args) -> LLM:
    engine_args.setdefault("block_size", 16)
    return LLM(
        str(folder),
        kv_cache_memory="2MiB",
        max_num_seqs=4,
        max_num_batched_tokens=24,
        **engine_args,
    )


def generate(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def stacked(module) -> bool:
    return isinstance(module.decoder_stack, DecoderStack)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("decoder_stack")
    return {name: write_tiny_model(root / name, spec) for name, spec in SPECS.items()}


def run_modules(module, *args) -> torch.Tensor:
    """``module``'s layers and norm as modules, its stack (whatever it is now) set aside."""
    stack, module.decoder_stack = module.decoder_stack, None
    try:
        return module.run_layers(*args)
    finally:
        module.decoder_stack = stack


def check_every_call(module, calls: list) -> None:
    """Run the modules, then the stack, at every call of ``module``'s stack; record whether
    they agreed (the modules write the step's KV first, the stack writes it again)."""
    stack = module.decoder_stack

    def both(hidden, cos_sin, metadata):
        expected = run_modules(module, hidden, cos_sin, metadata)
        got = stack(hidden, cos_sin, metadata)
        calls.append((hidden.shape[0], metadata.num_reqs, torch.equal(got, expected)))
        return expected

    module.decoder_stack = both


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_stack_gives_the_modules_hidden_states_bit_for_bit(models, name, block_size):
    llm = make_llm(models[name], block_size=block_size)
    target = llm.engine.core.runner.model.model
    assert stacked(target)
    calls: list = []
    check_every_call(target, calls)
    generate(llm)
    assert all(equal for _, _, equal in calls), calls
    assert any(tokens > reqs > 1 for tokens, reqs, _ in calls), "no step mixed prefill and decodes"
    assert any(tokens == reqs for tokens, reqs, _ in calls), "no decode-only step"


def test_padding_rows_after_the_steps_tokens_come_out_as_the_modules_give_them(models):
    llm = make_llm(models["llama-gqa"])
    target = llm.engine.core.runner.model.model
    stack = target.decoder_stack
    agreed = []

    def padded(hidden, cos_sin, metadata):
        def pad(t):  # two rows after the step's tokens
            return torch.cat([t, t[:2]])

        args = (
            pad(hidden),
            tuple(pad(t) for t in cos_sin),
            dataclasses.replace(metadata, num_actual_tokens=hidden.shape[0]),
        )
        expected = run_modules(target, hidden, cos_sin, metadata)
        with_padding = run_modules(target, *args)
        got = stack(*args)
        agreed.append(
            torch.equal(got, with_padding) and torch.equal(got[: hidden.shape[0]], expected)
        )
        return expected

    target.decoder_stack = padded
    generate(llm)
    assert agreed and all(agreed)


def test_an_eagle_heads_layer_runs_as_a_stack_bit_for_bit(models, tmp_path):
    head = write_random_eagle_head(tmp_path / "head", models["llama-gqa"], seed=1)
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": 3, "adaptive": False}
    llm = make_llm(models["llama-gqa"], speculative_config=spec)
    runner = llm.engine.core.runner
    head_model = runner.speculation.proposer.model
    assert stacked(head_model) and stacked(runner.model.model)
    head_model.head_pass = None  # whose greedy drafts call the stack from C++, not through it
    calls: list = []
    check_every_call(head_model, calls)
    generate(llm)
    assert len(calls) > 10 and all(equal for _, _, equal in calls), calls


def test_the_stack_keeps_greedy_tokens(models, monkeypatch):
    with_stack = make_llm(models["llama-gqa"])
    monkeypatch.setenv(STACK_ENV, "0")
    modules = make_llm(models["llama-gqa"])
    assert stacked(with_stack.engine.core.runner.model.model)
    assert modules.engine.core.runner.model.model.decoder_stack is None
    assert generate(with_stack) == generate(modules)


def check_bit_for_bit(llm: LLM) -> list[list[int]]:
    target = llm.engine.core.runner.model.model
    assert stacked(target)
    calls: list = []
    check_every_call(target, calls)
    tokens = generate(llm)
    assert calls and all(equal for _, _, equal in calls), calls
    return tokens


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-biases", "qwen3-qk-norms"])
def test_a_bfloat16_model_on_the_compiled_gemm_runs_as_a_stack_bit_for_bit(
    models, name, monkeypatch
):
    """bfloat16 hidden states, weights stored in bfloat16 for the compiled GEMM (its default
    where the CPU has no native bfloat16 matmul, OCTAVO_CPU_GEMM=compiled elsewhere)."""
    monkeypatch.setenv(GEMM_ENV, "compiled")
    llm = make_llm(models[name], dtype="bfloat16")
    assert llm.engine.core.runner.model.model.layers[0].input_layernorm.weight.dtype == (
        torch.bfloat16
    )
    check_bit_for_bit(llm)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_projections_with_biases_run_as_a_stack_bit_for_bit(models, dtype):
    """``--quantization int8`` on a Qwen2 (q/k/v biases): the int8 kernel takes float32 rows,
    so in a bfloat16 model the bias is added before the rounding, in the modules and the stack."""
    llm = make_llm(models["qwen2-biases"], dtype=dtype, quantization="int8")
    layer = llm.engine.core.runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.uint8
    check_bit_for_bit(llm)


@pytest.mark.parametrize("quant_type", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-biases", "qwen3-qk-norms"])
def test_a_quantized_gguf_model_runs_as_a_stack_bit_for_bit(models, name, quant_type, tmp_path):
    pytest.importorskip("gguf")
    from octavo.testing.tiny_gguf import write_gguf

    path = write_gguf(models[name], tmp_path / f"{name}.{quant_type}.gguf", quant_type)
    llm = make_llm(path)
    layer = llm.engine.core.runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.uint8  # kept quantized
    check_bit_for_bit(llm)


def test_a_model_with_an_output_projection_bias_runs_its_modules(tmp_path):
    spec = TinyModelSpec(attention_bias=True)  # Llama's option: q/k/v and o biases
    llm = make_llm(write_tiny_model(tmp_path / "model", spec))
    assert llm.engine.core.runner.model.model.decoder_stack is None


def test_onednn_layers_and_the_torch_path_run_their_modules(models, monkeypatch):
    monkeypatch.setenv(GEMM_ENV, "onednn")
    onednn = make_llm(models["llama-gqa"], dtype="bfloat16")
    assert onednn.engine.core.runner.model.model.decoder_stack is None
    monkeypatch.delenv(GEMM_ENV)
    monkeypatch.setattr(plugin, "load_kernels", lambda: kernels._load("torch"))
    torch_path = make_llm(models["llama-gqa"])
    assert torch_path.engine.core.runner.model.model.decoder_stack is None
