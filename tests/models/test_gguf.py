"""GGUF checkpoints: octavo on a GGUF file against octavo on the folder it was written from
(float32 tensors: the same weights, so the q/k un-permutation, the names and the config from the
metadata are checked exactly), against transformers' own GGUF loading of the file (quantized
tensors, dequantized at load), and its native kernels against the dequantized path."""

from __future__ import annotations

import pytest
import torch
from model_cases import PROMPTS, make_prompts
from test_greedy import run_greedy

from octavo.errors import ConfigError
from octavo.model_executor.model_config import ModelConfig
from octavo.testing.tiny_gguf import write_gguf
from octavo.testing.tiny_models import TinyModelSpec, write_tiny_model

pytest.importorskip("gguf")

MAX_TOKENS = 24
SPECS = {  # each with a feature of its family a GGUF file must carry
    "LlamaForCausalLM": TinyModelSpec("LlamaForCausalLM", tie_word_embeddings=True, seed=11),
    "Qwen2ForCausalLM": TinyModelSpec("Qwen2ForCausalLM", seed=12),  # q/k/v biases
    "Qwen3ForCausalLM": TinyModelSpec("Qwen3ForCausalLM", head_dim=32, seed=13),  # q/k norms
}
GREEDY_PROMPTS = make_prompts((1, 5, 9, 14, 19, 26, 33, 40), 512, seed=7)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_models")
    return {arch: write_tiny_model(root / arch, spec) for arch, spec in SPECS.items()}


@pytest.fixture(scope="module")
def gguf_files(folders):
    """``(arch, type) -> file``, written on first use."""
    written = {}

    def get(arch: str, quant_type: str):
        if (arch, quant_type) not in written:
            out = folders[arch].parent / f"{arch}.{quant_type}.gguf"
            written[arch, quant_type] = write_gguf(folders[arch], out, quant_type)
        return written[arch, quant_type]

    return get


def transformers_greedy(path, prompts, max_new_tokens):
    """transformers' greedy tokens on a GGUF file it loads (and dequantizes) itself."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture
def dequantizing(octavo_platform, monkeypatch):
    """The selected platform as one without quantized kernels: GGUF weights dequantized."""
    monkeypatch.setattr(octavo_platform, "quantized_linear_packer", lambda quant_type: None)
    return octavo_platform


@pytest.mark.parametrize("arch", SPECS)
def test_float32_gguf_runs_as_its_folder(arch, folders, gguf_files, make_runner):
    path = gguf_files(arch, "F32")
    config = ModelConfig.from_folder(path)
    assert config.is_gguf and config.architecture == arch
    assert config.head_dim == (SPECS[arch].head_dim or 16)
    assert config.tie_word_embeddings == SPECS[arch].tie_word_embeddings
    expected = run_greedy(make_runner(folders[arch]), PROMPTS, MAX_TOKENS)
    assert run_greedy(make_runner(path), PROMPTS, MAX_TOKENS) == expected


@pytest.mark.parametrize("quant_type", ("Q8_0", "Q4_0"))
@pytest.mark.parametrize("arch", ("LlamaForCausalLM", "Qwen2ForCausalLM"))
def test_dequantized_gguf_matches_transformers(
    arch, quant_type, gguf_files, make_runner, dequantizing
):
    path = gguf_files(arch, quant_type)
    outputs = run_greedy(make_runner(path), GREEDY_PROMPTS, MAX_TOKENS)
    assert outputs == transformers_greedy(path, GREEDY_PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("quant_type", ("Q8_0", "Q4_0"))
@pytest.mark.parametrize("arch", SPECS)
def test_native_kernels_agree_with_dequantized(
    arch, quant_type, gguf_files, make_runner, octavo_platform, monkeypatch
):
    """The platform's kernels over the kept blocks (which may round the activations to 8 bits)
    give the dequantized path's next token on most prompts. (Only the next: a random-weight
    model's logits are so close together that any rounding soon leads its greedy text
    elsewhere; the real model's test compares whole outputs.)"""
    if octavo_platform.quantized_linear_packer(quant_type) is None:
        pytest.skip(f"platform {octavo_platform.name!r} has no {quant_type} kernel here")
    path = gguf_files(arch, quant_type)
    runner = make_runner(path)
    kept = [m.quant_method for m in runner.model.modules() if hasattr(m, "quant_method")]
    assert any(getattr(q, "quant_type", None) == quant_type for q in kept)
    native = run_greedy(runner, GREEDY_PROMPTS, 1)
    monkeypatch.setattr(octavo_platform, "quantized_linear_packer", lambda quant_type: None)
    dequantized = run_greedy(make_runner(path), GREEDY_PROMPTS, 1)
    agree = sum(a == b for a, b in zip(native, dequantized))
    assert agree >= len(GREEDY_PROMPTS) * 3 // 4, (agree, native, dequantized)


def test_not_a_gguf_file_is_a_config_error(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"this is not a GGUF file at all" * 10)
    with pytest.raises(ConfigError, match="model.gguf.*not a readable GGUF file"):
        ModelConfig.from_folder(path)


def test_truncated_gguf_is_a_config_error(gguf_files, tmp_path):
    data = gguf_files("LlamaForCausalLM", "Q8_0").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="cut.gguf.*truncated"):
        ModelConfig.from_folder(path)


def test_folder_with_two_gguf_files_is_a_config_error(gguf_files, tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(gguf_files("LlamaForCausalLM", "F32").read_bytes())
    with pytest.raises(ConfigError, match="2 GGUF files.*a.gguf, b.gguf"):
        ModelConfig.from_folder(tmp_path)


def test_folder_with_one_gguf_file_loads_it(gguf_files, tmp_path):
    (tmp_path / "only.gguf").write_bytes(gguf_files("LlamaForCausalLM", "F32").read_bytes())
    assert ModelConfig.from_folder(tmp_path).model_path == (tmp_path / "only.gguf").resolve()


def test_unsupported_architecture_is_a_config_error(tmp_path):
    import gguf

    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi2")
    for add in (writer.add_block_count, writer.add_embedding_length, writer.add_head_count):
        add(4)
    writer.add_context_length(64)
    writer.add_feed_forward_length(8)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="phi.gguf.*'phi2'.*llama, qwen2, qwen3"):
        ModelConfig.from_folder(path)


def test_tokenizer_from_the_file_encodes_as_the_folders(folders, gguf_files, tmp_path):
    from octavo.model_executor.tokenizer import load_tokenizer

    path = gguf_files("LlamaForCausalLM", "F32")
    text = "once upon a time there was a little girl named lily. she loved the park!"
    expected = load_tokenizer(folders["LlamaForCausalLM"], cache_dir=tmp_path).encode(text)
    first = load_tokenizer(path, cache_dir=tmp_path)  # transformers converts the metadata
    again = load_tokenizer(path, cache_dir=tmp_path)  # from the cache file it wrote
    assert first.encode(text) == again.encode(text) == expected
    assert first.decode(expected, skip_special_tokens=True) == text


def test_quantization_flag_on_a_gguf_file_is_refused(gguf_files, octavo_platform):
    from octavo.model_executor.loader import load_model

    config = ModelConfig.from_folder(gguf_files("LlamaForCausalLM", "Q8_0"))
    with pytest.raises(ConfigError, match="GGUF file, quantized already: drop --quantization"):
        load_model(config, octavo_platform, block_size=16, device="cpu", quantization="fp8")


def test_tokenizer_of_another_vocabulary_is_refused(folders, tmp_path):
    from octavo import LLM

    bigger = write_tiny_model(tmp_path / "big", TinyModelSpec(vocab_size=1024))
    with pytest.raises(ConfigError, match="1024 tokens, more than the model's vocabulary of 512"):
        LLM(str(folders["LlamaForCausalLM"]), tokenizer=str(bigger))
