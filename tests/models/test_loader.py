"""Loading a local HuggingFace folder: what loads, and the errors that say what is wrong."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from model_cases import ARCHITECTURES
from safetensors.torch import load_file, save_file

from octavo.errors import ConfigError
from octavo.model_executor.loader import load_model
from octavo.model_executor.model_config import ModelConfig
from octavo.testing.tiny_models import TinyModelSpec, write_tiny_model


def config_of(path, platform, **kwargs) -> ModelConfig:
    return ModelConfig.from_folder(
        path, supported_dtypes=platform.capabilities.dtypes, platform_name=platform.name, **kwargs
    )


def load(path, platform, **kwargs):
    return load_model(config_of(path, platform, **kwargs), platform, block_size=16, device="cpu")


@pytest.fixture
def llama_copy(tiny_models, tmp_path):
    """A private copy of the tiny Llama folder that a test may damage."""
    return shutil.copytree(tiny_models["LlamaForCausalLM"], tmp_path / "model")


def edit_config(path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_sharded_checkpoint_loads_the_same_weights(tmp_path, octavo_platform):
    spec = TinyModelSpec("Qwen2ForCausalLM", seed=11)
    single = write_tiny_model(tmp_path / "single", spec)
    sharded = write_tiny_model(tmp_path / "sharded", spec, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file() and not (
        sharded / "model.safetensors"
    ).exists()
    a, b = load(single, octavo_platform), load(sharded, octavo_platform)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def test_tied_embeddings_share_one_tensor(tiny_models, octavo_platform):
    model = load(tiny_models["Qwen2ForCausalLM"], octavo_platform)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_dtype_auto_follows_the_checkpoint(tmp_path, octavo_platform):
    if torch.bfloat16 not in octavo_platform.capabilities.dtypes:
        pytest.skip("platform has no bfloat16")
    path = write_tiny_model(tmp_path / "bf16", TinyModelSpec(), dtype=torch.bfloat16)
    model = load(path, octavo_platform)
    assert config_of(path, octavo_platform).dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_explicit_dtype_the_platform_lacks_is_refused(tiny_models, octavo_platform):
    lacking = [
        d
        for d in ("float16", "bfloat16")
        if getattr(torch, d) not in octavo_platform.capabilities.dtypes
    ]
    if not lacking:
        pytest.skip("platform offers every dtype")
    with pytest.raises(
        ConfigError, match=f"dtype {lacking[0]} is not supported by platform.*offers: float32"
    ):
        config_of(tiny_models["LlamaForCausalLM"], octavo_platform, dtype=lacking[0])


def test_unknown_dtype(tiny_models, octavo_platform):
    with pytest.raises(
        ConfigError, match="unknown dtype 'float8'.*auto, float32, bfloat16, float16"
    ):
        config_of(tiny_models["LlamaForCausalLM"], octavo_platform, dtype="float8")


def test_missing_folder(tmp_path, octavo_platform):
    with pytest.raises(ConfigError, match="does not exist"):
        config_of(tmp_path / "nowhere", octavo_platform)


def test_hub_id_says_models_must_be_local(octavo_platform):
    with pytest.raises(
        ConfigError, match="local folders only.*huggingface-cli download meta-llama/Llama-3-8B"
    ):
        config_of("meta-llama/Llama-3-8B", octavo_platform)


def test_file_instead_of_folder(llama_copy, octavo_platform):
    with pytest.raises(ConfigError, match="is neither a folder nor a .gguf file"):
        config_of(llama_copy / "config.json", octavo_platform)


def test_folder_without_config(llama_copy, octavo_platform):
    (llama_copy / "config.json").unlink()
    with pytest.raises(ConfigError, match="has no config.json"):
        config_of(llama_copy, octavo_platform)


def test_folder_without_weights(llama_copy, octavo_platform):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no model.safetensors or model.safetensors.index.json"):
        load(llama_copy, octavo_platform)


def test_unsupported_architecture_lists_the_supported_ones(llama_copy, octavo_platform):
    edit_config(llama_copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError, match="'GPT2LMHeadModel'.*not supported") as error:
        load(llama_copy, octavo_platform)
    listed = str(error.value).split("supported architectures: ", 1)[1].split(", ")
    assert listed == sorted(listed) and set(ARCHITECTURES) <= set(listed)


def test_missing_tensor_is_named(llama_copy, octavo_platform):
    tensors = load_file(llama_copy / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, llama_copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ConfigError, match="missing 1 tensor.*'model.layers.1.self_attn.k_proj.weight'"
    ):
        load(llama_copy, octavo_platform)


def test_tensor_of_the_wrong_shape_is_named(llama_copy, octavo_platform):
    edit_config(llama_copy, intermediate_size=96)
    with pytest.raises(
        ConfigError,
        match=r"'model.layers.0.mlp.down_proj.weight' has shape \[64, 128\] "
        r"but the model config implies \[64, 96\]",
    ):
        load(llama_copy, octavo_platform)


def test_unsupported_rope_scaling_is_refused(llama_copy, octavo_platform):
    edit_config(
        llama_copy, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    )
    with pytest.raises(
        ConfigError,
        match="rope scaling type 'dynamic' is not supported; "
        "supported types: default, linear, llama3",
    ):
        config_of(llama_copy, octavo_platform)


def test_max_model_len_beyond_the_model(llama_copy, octavo_platform):
    with pytest.raises(
        ConfigError, match="max_model_len 4096 exceeds the model's max_position_embeddings"
    ):
        config_of(llama_copy, octavo_platform, max_model_len=4096)


def test_generation_config_and_special_tokens(stories260k_path, octavo_platform):
    config = config_of(stories260k_path, octavo_platform)
    assert (config.architecture, config.dtype, config.tie_word_embeddings) == (
        "LlamaForCausalLM",
        torch.float32,
        True,
    )
    assert (config.bos_token_id, config.eos_token_ids, config.max_model_len) == (1, (2,), 512)
    assert config.head_dim == 8 and config.num_key_value_heads == 4


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantizing_a_mixture_of_experts_model_is_refused(
    tiny_models, octavo_platform, quantization
):
    """--quantization covers linear layers only: on an MoE model its experts would stay in the
    model dtype, so the flag is refused rather than half applied."""
    config = config_of(tiny_models["MixtralForCausalLM"], octavo_platform)
    with pytest.raises(ConfigError, match="does not cover Mixture-of-Experts"):
        load_model(config, octavo_platform, block_size=16, device="cpu", quantization=quantization)


def test_expert_parallelism_is_refused(tiny_models):
    from octavo.config import EngineArgs

    with pytest.raises(ConfigError, match="expert parallelism is not built"):
        EngineArgs(model=str(tiny_models["MixtralForCausalLM"]), enable_expert_parallel=True)


def test_phi3_partial_rotary_factor_is_refused(tiny_models, octavo_platform, tmp_path):
    folder = shutil.copytree(tiny_models["Phi3ForCausalLM"], tmp_path / "phi3")
    edit_config(
        folder,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75},
    )
    with pytest.raises(ConfigError, match="partial_rotary_factor 0.75"):
        load(folder, octavo_platform)
