"""The real model of the benchmarks (SmolLM2-135M-Instruct, fetched by benchmarks/real_model.py;
skipped without it): octavo's greedy tokens on its float32 folder equal transformers', on its
Q4_1 GGUF file dequantized equal transformers' own GGUF loading, and the native kernels' (Q4_1,
and Q8_0 and Q4_0 where their files were made) equal the dequantized path's on most of 16 chat
prompts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_greedy import run_greedy

MODEL = Path(__file__).resolve().parents[2] / "benchmarks" / ".models" / "smollm2-135m-instruct"
GGUF = MODEL / "SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_TOKENS = 16
MESSAGES = (
    "What is the capital of France?", "Write a haiku about the sea.",
    "Write a Python function that reverses a string.", "Explain gravity in one sentence.",
    "List three colors.", "What is 12 times 7?", "Translate 'good morning' into French.",
    "Give me a tip for learning to code.", "Who wrote Romeo and Juliet?",
    "Describe a cat in two sentences.", "What is the boiling point of water?",
    "Name a planet in our solar system.", "Write a SQL query counting the rows of users.",
    "Why is the sky blue?", "Suggest a name for a pet dog.", "What does CPU stand for?",
)  # fmt: skip

pytestmark = pytest.mark.skipif(
    not (MODEL / "hf-f32").is_dir() or not GGUF.is_file(),
    reason="the real model is fetched by benchmarks/real_model.py",
)


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(MODEL / "hf-f32"))
    chats = [[{"role": "user", "content": m}] for m in MESSAGES]
    rendered = [tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in chats]
    return [list(r["input_ids"] if hasattr(r, "keys") else r) for r in rendered]


def transformers_greedy(prompts, **load):
    """transformers' greedy tokens, EOS ignored; the attention mask given, since the prompts hold
    <|im_end|>, the model's pad token, which generate() would otherwise mask out."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dtype=torch.float32, **load).eval()
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def octavo_greedy(make_runner, path, prompts):
    """Greedy tokens, eight prompts at a time (the runner's max_num_seqs)."""
    runner = make_runner(path, max_model_len=512)
    return [
        out
        for i in range(0, len(prompts), 8)
        for out in run_greedy(runner, prompts[i : i + 8], MAX_TOKENS)
    ]


def test_float32_folder_matches_transformers(make_runner, prompts):
    expected = transformers_greedy(prompts, pretrained_model_name_or_path=str(MODEL / "hf-f32"))
    assert octavo_greedy(make_runner, MODEL / "hf-f32", prompts) == expected


def test_dequantized_gguf_matches_transformers_gguf(
    make_runner, prompts, octavo_platform, monkeypatch
):
    expected = transformers_greedy(
        prompts, pretrained_model_name_or_path=str(MODEL), gguf_file=GGUF.name
    )
    monkeypatch.setattr(octavo_platform, "quantized_linear_packer", lambda quant_type: None)
    assert octavo_greedy(make_runner, GGUF, prompts) == expected


@pytest.mark.parametrize(
    "quant_type, path",
    [("Q4_1", GGUF), ("Q8_0", MODEL / "model.Q8_0.gguf"), ("Q4_0", MODEL / "model.Q4_0.gguf")],
    ids=("Q4_1", "Q8_0", "Q4_0"),
)
def test_native_kernels_agree_with_dequantized(
    make_runner, prompts, octavo_platform, monkeypatch, quant_type, path
):
    if octavo_platform.quantized_linear_packer(quant_type) is None:
        pytest.skip(f"platform {octavo_platform.name!r} has no {quant_type} kernel here")
    if not path.is_file():
        pytest.skip(f"{path.name} is made by benchmarks/real_model.py (with llama.cpp)")
    native = octavo_greedy(make_runner, path, prompts)
    monkeypatch.setattr(octavo_platform, "quantized_linear_packer", lambda quant_type: None)
    dequantized = octavo_greedy(make_runner, path, prompts)
    same = sum(a == b for a, b in zip(native, dequantized))
    print(f"{quant_type}: native greedy tokens equal the dequantized path's on {same} of 16")
    assert same >= 12
