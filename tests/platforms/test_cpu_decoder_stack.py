"""The cpu platform's decoder stack (one compiled call for Llama decoder layers and their final
norm): the same hidden states as the modules, bit for bit, in every step of mixed batches, for
a target model and an EAGLE head; the modules wherever it does not apply."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.testing.tiny_models import TinyModelSpec, write_random_eagle_head, write_tiny_model
from octavo_cpu import kernels, plugin
from octavo_cpu.decoder_stack import STACK_ENV, DecoderStack

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
    assert llm.engine.core.runner.model.model.decoder_stack is None


def test_a_bfloat16_model_and_the_torch_path_run_their_modules(models, monkeypatch):
    bf16 = make_llm(models["llama-gqa"], dtype="bfloat16")
    assert bf16.engine.core.runner.model.model.decoder_stack is None
    monkeypatch.setattr(plugin, "load_kernels", lambda: kernels._load("torch"))
    torch_path = make_llm(models["llama-gqa"])
    assert torch_path.engine.core.runner.model.model.decoder_stack is None
