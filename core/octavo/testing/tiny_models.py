"""Random-weight HuggingFace checkpoints of the Llama family (its MoE members included), written
to a folder with a tokenizer.

Tests build tiny ones in fixtures; benchmarks build ~100M-parameter ones. The folder is an
ordinary HF model folder (config.json, safetensors, generation_config.json, tokenizer files), so
transformers and octavo load exactly the same weights.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any, Optional, Union

import torch

ARCHITECTURE_CONFIGS = {
    "LlamaForCausalLM": "LlamaConfig",
    "MistralForCausalLM": "MistralConfig",
    "Qwen2ForCausalLM": "Qwen2Config",
    "Qwen3ForCausalLM": "Qwen3Config",
    "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
    "MixtralForCausalLM": "MixtralConfig",
    "Phi3ForCausalLM": "Phi3Config",
    "Gemma3ForCausalLM": "Gemma3TextConfig",
    "DeepseekV2ForCausalLM": "DeepseekV2Config",
    "DeepseekV3ForCausalLM": "DeepseekV3Config",
}

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: unk, bos, eos

_WORDS = (
    "the a once upon time there was little girl boy named lily tom she he loved to play outside in "
    "park one day saw big red ball wanted with it but too high mom said and cat dog ran jumped "
    "happy sad tree house sun sky blue green friend friends toy toys car box water fish bird "
    "fly sing song eat cake apple good bad very fast slow run around they were went home"
).split()


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    """The shape of a random-weight model; defaults make a ~0.2M-parameter Llama."""

    architecture: str = "LlamaForCausalLM"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: Optional[int] = None  # None: hidden_size // num_attention_heads
    vocab_size: int = 512
    max_position_embeddings: int = 512
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = None
    tie_word_embeddings: bool = False
    sliding_window: Optional[int] = None
    attention_bias: bool = False  # Llama/Qwen3 option; Qwen2 always has q/k/v biases
    init_std: float = 0.1  # at 0.02 greedy output repeats one token
    seed: int = 0
    # Mixture of Experts (Qwen3-MoE, Mixtral): experts per MoE block and per token; Qwen3-MoE's
    # expert width (Mixtral's is intermediate_size)
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    # further config.json fields, as (name, value) pairs (e.g. Qwen3-MoE's mlp_only_layers; a
    # tuple value is written as a list)
    extra_config: tuple[tuple[str, Any], ...] = ()


def _hf_config(spec: TinyModelSpec):
    import transformers

    if spec.architecture not in ARCHITECTURE_CONFIGS:
        raise ValueError(
            f"no tiny-model recipe for {spec.architecture!r}; "
            f"choose one of {sorted(ARCHITECTURE_CONFIGS)}"
        )
    config_cls = getattr(transformers, ARCHITECTURE_CONFIGS[spec.architecture])
    rope = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.rope_scaling:
        rope = {**spec.rope_scaling, "rope_theta": spec.rope_theta}
    kwargs: dict[str, Any] = dict(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim or spec.hidden_size // spec.num_attention_heads,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=spec.init_std,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if spec.architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        kwargs["attention_bias"] = spec.attention_bias
    if spec.architecture in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        kwargs["sliding_window"] = spec.sliding_window
    elif spec.architecture.startswith("Qwen") and spec.sliding_window is not None:
        kwargs.update(
            use_sliding_window=True, sliding_window=spec.sliding_window, max_window_layers=0
        )
    if spec.architecture == "Qwen3MoeForCausalLM":
        kwargs.update(
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size,
        )
    elif spec.architecture in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        kwargs.update(
            n_routed_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size,
        )
        kwargs.pop("head_dim")  # DeepSeek's is qk_rope_head_dim
    elif spec.architecture == "MixtralForCausalLM":
        kwargs.update(
            num_local_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok
        )
    kwargs.update({k: list(v) if isinstance(v, tuple) else v for k, v in spec.extra_config})
    config = config_cls(**kwargs)
    config.architectures = [spec.architecture]
    return config


@torch.no_grad()
def _randomize(model: torch.nn.Module, std: float, seed: int) -> None:
    """Every weight ~ N(0, std); norm weights ~ 1 + N(0, std); biases (and DeepSeek's router
    score-correction bias) ~ N(0, std)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
        if name.endswith("norm.weight"):
            noise += 1.0
        param.copy_(noise.to(param.dtype))
    for name, buffer in model.named_buffers():  # DeepSeek's router bias is a buffer
        if name.endswith("e_score_correction_bias"):
            noise = torch.randn(buffer.shape, generator=generator, dtype=torch.float32) * std
            buffer.copy_(noise.to(buffer.dtype))


def _corpus(num_sentences: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14))) + "."
        for _ in range(num_sentences)
    ]


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer of exactly ``vocab_size`` tokens (ids 0/1/2 = unk/bos/eos).

    Trained on a small generated corpus, then padded with filler tokens so that every id a
    random model can emit decodes to something.
    """
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    base = len(SPECIAL_TOKENS) + 256
    if vocab_size < base:
        raise ValueError(
            f"vocab_size must be >= {base} for a byte-level tokenizer, got {vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, base + 200),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    state = json.loads(tokenizer.to_str())
    vocab = state["model"]["vocab"]
    for filler in range(len(vocab), vocab_size):
        vocab[f"<x{filler}>"] = filler
    tokenizer = Tokenizer.from_str(json.dumps(state))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<unk>",
    )


def write_tiny_model(
    folder: Union[str, Path],
    spec: TinyModelSpec = TinyModelSpec(),
    *,
    dtype: torch.dtype = torch.float32,
    max_shard_size: Optional[str] = None,
) -> Path:
    """Write a random-weight HF checkpoint of ``spec`` (weights in ``dtype``) into ``folder``.

    ``max_shard_size`` (e.g. ``"100KB"``) splits the weights into a sharded
    ``model.safetensors.index.json`` checkpoint. Returns the folder.
    """
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = _hf_config(spec)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, spec.init_std, spec.seed)
    model = model.to(dtype)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=1, eos_token_id=2, pad_token_id=0
    )
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **save_kwargs)
    build_tokenizer(spec.vocab_size).save_pretrained(folder)
    return folder


def write_random_eagle_head(
    folder: Path,
    target: Path,
    seed: int = 0,
    std: float = 0.1,
    parallel_drafting: bool = False,
    layers: int = 1,
) -> Path:
    """An EAGLE head of ``layers`` decoder layers and random weights for the model in ``target``
    (its drafts are mostly rejected: for tests of losslessness, not of acceptance); with
    ``parallel_drafting``, the P-EAGLE mask inputs too (``octavo.spec_decode.p_eagle``)."""
    import json

    from octavo.spec_decode.eagle_head import head_config, head_tensor_shapes

    config = head_config(json.loads((target / "config.json").read_text()), layers)
    shapes = head_tensor_shapes(config)
    if parallel_drafting:
        shapes.update(mask_embedding=(config["hidden_size"],), mask_hidden=(config["hidden_size"],))
    return _write_random_head(folder, config, shapes, seed, std)


def write_random_gumiho_head(
    folder: Path, target: Path, num_parallel_heads: int = 3, seed: int = 0, std: float = 0.1
) -> Path:
    """A Gumiho head of random weights for the model in ``target`` (``octavo.spec_decode.gumiho``:
    2 serial drafts, ``num_parallel_heads`` MLP heads), for tests of losslessness."""
    import json

    from octavo.spec_decode.eagle_head import head_tensor_shapes
    from octavo.spec_decode.gumiho import gumiho_head_config, parallel_head_tensor_shapes

    target_config = json.loads((target / "config.json").read_text())
    config = gumiho_head_config(target_config, num_parallel_heads, target_config["hidden_size"])
    shapes = {**head_tensor_shapes(config), **parallel_head_tensor_shapes(config)}
    return _write_random_head(folder, config, shapes, seed, std)


def _write_random_head(folder: Path, config: dict, shapes: dict, seed: int, std: float) -> Path:
    import json

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=generator) * std
        tensors[name] = noise + 1.0 if name.endswith("norm.weight") else noise
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def add_random_mtp_layer(folder: Path, seed: int = 0, std: float = 0.1) -> Path:
    """Give the model in ``folder`` one random MTP layer in DeepSeek-V3's format (the format:
    ``octavo.spec_decode.mtp``; its drafts are mostly rejected: for tests of losslessness),
    including the copies of the embedding and head such checkpoints store."""
    import json

    from safetensors.torch import load_file, save_file

    from octavo.spec_decode.eagle_head import head_tensor_shapes

    config_path = Path(folder) / "config.json"
    config = json.loads(config_path.read_text())
    prefix = f"model.layers.{config['num_hidden_layers']}."
    weights_path = Path(folder) / "model.safetensors"
    tensors = load_file(str(weights_path))
    generator = torch.Generator().manual_seed(seed)
    renames = {"fc.weight": "eh_proj.weight", "norm.weight": "shared_head.norm.weight"}
    shapes = head_tensor_shapes({**config, "num_hidden_layers": 1})  # an MTP layer's names
    shapes.update({"enorm.weight": shapes["norm.weight"], "hnorm.weight": shapes["norm.weight"]})
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=generator) * std
        name = renames.get(name, name.removeprefix("layers.0."))
        tensors[prefix + name] = noise + 1.0 if name.endswith("norm.weight") else noise
    embedding = tensors["model.embed_tokens.weight"]
    tensors[prefix + "embed_tokens.weight"] = embedding.clone()
    tensors[prefix + "shared_head.head.weight"] = tensors.get("lm_head.weight", embedding).clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(weights_path))
    config["num_nextn_predict_layers"] = 1
    config_path.write_text(json.dumps(config, indent=2))
    return Path(folder)
