"""The cpu platform's decoder stack (one compiled call for a Llama model's layers): the same
hidden states as the modules, bit for bit, in every step of mixed batches; the modules wherever
it does not apply."""

from __future__ import annotations

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.testing.tiny_models import TinyModelSpec, write_tiny_model
from octavo_cpu import kernels, plugin
from octavo_cpu.decoder_stack import STACK_ENV, DecoderStackForward

pytestmark = pytest.mark.skipif(
    kernels.load_kernels().ops is None, reason="the compiled kernels do not run here"
)

SPECS = {
    "llama-gqa": TinyModelSpec(),
    "llama-head-dim-8": TinyModelSpec(hidden_size=32, num_attention_heads=4, head_dim=8),
    "mistral-window-6": TinyModelSpec(architecture="MistralForCausalLM", sliding_window=6),
}
# Prompts of 37, 5, 21 and 2 tokens, 24 tokens a step: prefill chunks mixed with decodes.
PROMPTS = [
    [1] + [(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((36, 4, 20, 1))
]


def make_llm(folder, **engine_args) -> LLM:
    engine_args.setdefault("block_size", 16)
    return LLM(
        str(folder),
        kv_cache_memory="2MiB",
        max_num_seqs=4,
        max_num_batched_tokens=24,
        **engine_args,
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("decoder_stack")
    return {name: write_tiny_model(root / name, spec) for name, spec in SPECS.items()}


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_stack_gives_the_modules_hidden_states_bit_for_bit(models, name, block_size):
    llm = make_llm(models[name], block_size=block_size)
    threaded = llm.engine.core.runner.forward
    stack = threaded.model
    assert isinstance(stack, DecoderStackForward)
    steps = []

    def both(input_ids, positions, metadata):
        expected = stack.model(input_ids, positions, metadata)  # the modules write the KV first
        got = stack(input_ids, positions, metadata)  # then the stack writes it again
        steps.append((input_ids.shape[0], metadata.num_reqs, torch.equal(got, expected)))
        return expected

    threaded.model = both
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert all(equal for _, _, equal in steps), steps
    assert any(tokens > reqs > 1 for tokens, reqs, _ in steps), "no step mixed prefill and decodes"
    assert any(tokens == reqs for tokens, reqs, _ in steps), "no decode-only step"


def test_the_stack_keeps_greedy_tokens(models, monkeypatch):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    stacked = make_llm(models["llama-gqa"])
    monkeypatch.setenv(STACK_ENV, "0")
    modules = make_llm(models["llama-gqa"])
    assert isinstance(stacked.engine.core.runner.forward.model, DecoderStackForward)
    assert not isinstance(modules.engine.core.runner.forward.model, DecoderStackForward)
    ids = [
        [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        for llm in (stacked, modules)
    ]
    assert ids[0] == ids[1]


@pytest.mark.parametrize(
    "spec",
    [
        TinyModelSpec(architecture="Qwen2ForCausalLM"),  # q/k/v biases
        TinyModelSpec(architecture="Qwen3ForCausalLM"),  # per-head q/k norms
        TinyModelSpec(attention_bias=True),
    ],
    ids=["qwen2", "qwen3", "llama-bias"],
)
def test_models_the_stack_does_not_fit_run_their_modules(tmp_path, spec):
    llm = make_llm(write_tiny_model(tmp_path / "model", spec))
    assert not isinstance(llm.engine.core.runner.forward.model, DecoderStackForward)


def test_a_bfloat16_model_and_the_torch_path_run_their_modules(models, monkeypatch):
    bf16 = make_llm(models["llama-gqa"], dtype="bfloat16")
    assert not isinstance(bf16.engine.core.runner.forward.model, DecoderStackForward)
    monkeypatch.setattr(plugin, "load_kernels", lambda: kernels._load("torch"))
    torch_path = make_llm(models["llama-gqa"])
    assert not isinstance(torch_path.engine.core.runner.forward.model, DecoderStackForward)
