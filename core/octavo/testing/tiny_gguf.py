"""A HuggingFace Llama-family folder written as a GGUF file, the way llama.cpp's converter lays
one out, for tests of GGUF loading (no llama.cpp needed): its metadata keys, its byte-level BPE
tokenizer, its tensor names, its q/k row permutation (Llama, Mistral), each linear weight in the
GGUF type asked for (quantized by the ``gguf`` package), the rest in float32.

Tests compare octavo on the file with octavo on the folder (float32 types: the same weights)
and with transformers' own GGUF loading of the file (quantized types).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np
import torch

GGUF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",  # llama.cpp writes Mistral as llama
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
LINEAR_FRAGMENTS = ("_proj.",)


def write_gguf(folder: Path, out: Path, linear_type: str = "F32") -> Path:
    """Write ``folder``'s model (safetensors, config.json, tokenizer.json) to ``out`` with every
    linear weight in ``linear_type`` (a GGUF type name the ``gguf`` package can quantize)."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    arch = GGUF_ARCHITECTURES[config["architectures"][0]]
    writer = gguf.GGUFWriter(str(out), arch)
    _write_metadata(writer, config)
    _write_tokenizer(writer, folder)
    name_map = gguf.get_tensor_name_map(
        {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], config["num_hidden_layers"]
    )
    for name, tensor in sorted(load_file(str(folder / "model.safetensors")).items()):
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        values = _permuted(tensor.float(), name, config) if arch == "llama" else tensor.float()
        quant = linear_type if any(f in name for f in LINEAR_FRAGMENTS) else "F32"
        if name.endswith(".bias"):
            quant = "F32"
        _add_tensor(writer, gguf_name, values.numpy(), quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _write_metadata(writer, config: dict) -> None:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_name("tiny")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(config["vocab_size"])


def _write_tokenizer(writer, folder: Path) -> None:
    """The folder's byte-level BPE as llama.cpp's ``gpt2`` tokenizer model."""
    state = json.loads((folder / "tokenizer.json").read_text())
    vocab = state["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = {t["content"] for t in state.get("added_tokens", []) if t.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3: control
    writer.add_token_merges(merges)
    writer.add_unk_token_id(vocab.get("<unk>", 0))
    writer.add_bos_token_id(vocab.get("<s>", 1))
    writer.add_eos_token_id(vocab.get("</s>", 2))
    writer.add_add_bos_token(True)  # as the folder's post-processor does
    config_file = folder / "tokenizer_config.json"
    template = (
        json.loads(config_file.read_text()).get("chat_template") if config_file.is_file() else None
    )
    if template:
        writer.add_chat_template(template)


def _permuted(weight: torch.Tensor, name: str, config: dict) -> torch.Tensor:
    """llama.cpp's converter's q/k row order: each head's two rotary halves interleaved."""
    heads: Optional[int] = None
    if name.endswith("q_proj.weight"):
        heads = config["num_attention_heads"]
    elif name.endswith("k_proj.weight"):
        heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    if heads is None:
        return weight
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _add_tensor(writer, name: str, values: np.ndarray, quant: str) -> None:
    import gguf
    from gguf.quants import quantize

    qtype = gguf.GGMLQuantizationType[quant]
    if quant == "F32":
        writer.add_tensor(name, values.astype(np.float32))
        return
    writer.add_tensor(name, quantize(values.astype(np.float32), qtype), raw_dtype=qtype)
