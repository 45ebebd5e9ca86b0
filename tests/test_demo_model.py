"""The bundled demo model (core/octavo/data/demo-model): it loads, tokenizes and completes code.

The folder is committed and shipped as package data; scripts/train_demo_model.py produced it.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

import octavo

transformers = pytest.importorskip("transformers")

DEMO_MODEL_DIR = Path(octavo.__file__).resolve().parent / "data" / "demo-model"
EXPECTED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "README.md",
    "loss_curve.png",
    "metrics.json",
)
# Written for this test (not taken from the stdlib): indentation, a tab, a non-ASCII literal,
# a docstring, and an f-string.
PYTHON_SOURCE = '''class Account:
    """A bank account with a running balance."""

    def __init__(self, owner: str, balance: float = 0.0) -> None:
        self.owner = owner
        self.balance = balance

    def deposit(self, amount):
\tif amount <= 0:
\t    raise ValueError(f"amount must be positive, got {amount!r}")
        self.balance += amount
        return self.balance  # café ≠ cafe, λ
'''

# Plain, typical library code (also written for this test) for the "has it learned" check.
TYPICAL_SOURCE = '''import os
import sys


def read_lines(path, encoding="utf-8"):
    """Return the lines of the file at *path*, without line endings."""
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    with open(path, encoding=encoding) as f:
        return [line.rstrip("\\n") for line in f]


class Counter:
    """Count how many times each key was seen."""

    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1
        return self.counts[key]
'''


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, local_files_only=True)
    return model.eval()


def test_folder_has_every_file_and_fits_the_size_budget():
    missing = [name for name in EXPECTED_FILES if not (DEMO_MODEL_DIR / name).is_file()]
    assert not missing, f"demo model folder lacks {missing}; run scripts/train_demo_model.py"
    assert (DEMO_MODEL_DIR / "model.safetensors").stat().st_size < 20 * 2**20


def test_config_declares_float32_llama_with_the_tokenizers_special_ids(tokenizer):
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == "float32"
    assert (
        config["bos_token_id"]
        == tokenizer.bos_token_id
        == tokenizer.convert_tokens_to_ids("<|bos|>")
    )
    assert (
        config["eos_token_id"]
        == tokenizer.eos_token_id
        == tokenizer.convert_tokens_to_ids("<|eos|>")
    )
    generation = json.loads((DEMO_MODEL_DIR / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]
    assert len(tokenizer) == config["vocab_size"]


def test_loads_in_transformers_as_float32_with_the_reported_size(model):
    metrics = json.loads((DEMO_MODEL_DIR / "metrics.json").read_text())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == metrics["parameters"]
    assert (
        model.get_output_embeddings().weight.data_ptr()
        == model.get_input_embeddings().weight.data_ptr()
    )


def test_tokenizer_round_trips_python_source(tokenizer):
    ids = tokenizer(PYTHON_SOURCE).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == PYTHON_SOURCE
    # Byte-level BPE trained on code: far fewer tokens than bytes.
    assert len(ids) < len(PYTHON_SOURCE.encode("utf-8")) / 2.5


def test_chat_template_renders_the_turns_and_the_generation_prompt(tokenizer):
    messages = [
        {"role": "system", "content": "You complete Python."},
        {"role": "user", "content": "def add(a, b):"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|bos|><|im_start|>system\nYou complete Python.<|im_end|>\n"
        "<|im_start|>user\ndef add(a, b):<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3


def test_model_has_learned_python(model, tokenizer):
    """Loss on unseen code is far below what token frequencies alone give.

    A uniform guess scores ln 4096 = 8.3 nats/token; a unigram model of the training corpus about
    6.2 on this snippet; the committed model 2.07 (the one before it, trained on a third of the
    tokens, 2.94).
    """
    ids = tokenizer(TYPICAL_SOURCE, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss < 2.5, f"loss {loss:.2f} on plain Python: the committed weights look undertrained"


def parsable_lines(text: str) -> int:
    """How many leading lines of ``text`` form valid Python (0 if none do)."""
    lines = text.splitlines()
    for count in range(len(lines), 0, -1):
        try:
            ast.parse("\n".join(lines[:count]))
        except SyntaxError:
            continue
        return count
    return 0


def test_readme_completions_with_repetition_penalty_are_python():
    """The README's greedy completions under repetition_penalty parse as Python, cut at the last
    complete line: at least 8 lines of each (plain greedy, which loops, manages 2 or fewer)."""
    metrics = json.loads((DEMO_MODEL_DIR / "metrics.json").read_text())
    samples = metrics["samples_repetition_penalty"]
    assert set(samples) == {"def fibonacci(n):", "import os\n"}
    for prompt, completion in samples.items():
        lines = parsable_lines(prompt + completion)
        assert lines >= 8, f"only {lines} lines of {prompt + completion!r} parse as Python"


def _greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> list:
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(
            **inputs,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )
    return output[0, inputs["input_ids"].shape[1] :].tolist()


def test_greedy_completion_of_def_is_deterministic_and_not_degenerate(model, tokenizer):
    first = _greedy(model, tokenizer, "def ", max_new_tokens=24)
    second = _greedy(model, tokenizer, "def ", max_new_tokens=24)
    assert first == second
    assert len(set(first)) >= 4, f"degenerate completion {tokenizer.decode(first)!r}"
    text = tokenizer.decode(first, skip_special_tokens=True)
    assert "(" in text, f"'def ' should be completed by a signature, got {text!r}"


ENGINE_PROMPTS = ("def fibonacci(n):", "import os\n", "class ", "    def __init__(self")


@pytest.mark.slow
def test_octavo_greedy_output_equals_transformers(model, tokenizer):
    """The engine on the bundled folder: same prompt ids and same greedy tokens as transformers."""
    from octavo import LLM
    from octavo.sampling_params import SamplingParams

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(
            str(DEMO_MODEL_DIR), kv_cache_memory="8MiB", max_num_seqs=8, max_num_batched_tokens=512
        )
        outputs = llm.generate(
            list(ENGINE_PROMPTS), SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False
        )
    finally:
        torch.set_num_threads(previous)
    for prompt, output in zip(ENGINE_PROMPTS, outputs):
        assert output.prompt_token_ids == tokenizer(prompt).input_ids
        expected = _greedy(model, tokenizer, prompt, max_new_tokens=32)
        assert list(output.outputs[0].token_ids) == expected, prompt


@pytest.mark.slow
def test_octavo_reproduces_the_readme_completions_with_repetition_penalty(model, tokenizer):
    """What a user gets from the engine with ``repetition_penalty`` is what the README shows."""
    from octavo import LLM
    from octavo.sampling_params import SamplingParams

    metrics = json.loads((DEMO_MODEL_DIR / "metrics.json").read_text())
    penalty, samples = metrics["repetition_penalty"], metrics["samples_repetition_penalty"]
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(
            str(DEMO_MODEL_DIR), kv_cache_memory="8MiB", max_num_seqs=8, max_num_batched_tokens=512
        )
        params = SamplingParams(temperature=0.0, max_tokens=64, repetition_penalty=penalty)
        outputs = llm.generate(list(samples), params, use_tqdm=False)
    finally:
        torch.set_num_threads(previous)
    for (prompt, completion), output in zip(samples.items(), outputs):
        inputs = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            expected = model.generate(
                **inputs,
                do_sample=False,
                max_new_tokens=64,
                repetition_penalty=penalty,
                pad_token_id=tokenizer.pad_token_id,
            )
        assert (
            list(output.outputs[0].token_ids)
            == expected[0, inputs["input_ids"].shape[1] :].tolist()
        ), prompt
        assert tokenizer.decode(output.outputs[0].token_ids, skip_special_tokens=True) == completion
