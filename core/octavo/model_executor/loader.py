"""Building a model from a local HuggingFace folder: architecture lookup, safetensors (the
tokenizer: ``octavo.model_executor.tokenizer``)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional, Union

import torch
from torch import nn

from octavo.config import check_quantization
from octavo.errors import ConfigError
from octavo.model_executor.model_config import ModelConfig, read_json
from octavo.models.layers.fp8 import quantize_model
from octavo.models.layers.fused_moe import FusedExperts, pack_experts
from octavo.models.layers.linear import TPGroup
from octavo.models.weights import CheckpointTensor
from octavo.platform.facade import Platform
from octavo.quantization.gguf_file import GgufCheckpoint
from octavo.quantization.quantized_linear import (
    attach_quantized,
    keep_lm_head_quantized,
    keep_quantized,
    quantize_int8,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the single file, or every shard the index names."""
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    if (folder / INDEX_FILE).is_file():
        weight_map = read_json(folder / INDEX_FILE).get("weight_map") or {}
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ConfigError(
                f"{str(folder / INDEX_FILE)!r} names shard files that are missing: {missing}"
            )
        if not shards:
            raise ConfigError(f"{str(folder / INDEX_FILE)!r} has an empty weight_map")
        return [folder / s for s in shards]
    raise ConfigError(
        f"model folder {str(folder)!r} has no {SINGLE_FILE} or {INDEX_FILE}; octavo loads "
        "safetensors checkpoints only "
        "(convert .bin/.pth weights with transformers' save_pretrained)"
    )


def iterate_checkpoint(folder: Path) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every ``(name, tensor)`` of the checkpoint, one file at a time, each read lazily: a
    parameter's loader reads the slice it keeps (its rank's shard) and nothing else."""
    from safetensors import safe_open

    for path in checkpoint_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, CheckpointTensor(f.get_slice(name))


def model_class(config: ModelConfig, platform: Platform) -> type:
    """The class registered (through ``octavo_model_architectures``) for the config's
    architecture."""
    architectures = platform.model_architectures()
    if config.architecture not in architectures:
        where = config.model_path if config.is_gguf else config.model_path / "config.json"
        raise ConfigError(
            f"architecture {config.architecture!r} "
            f"(from {str(where)!r}) is not "
            f"supported; supported architectures: {', '.join(sorted(architectures)) or 'none'}"
        )
    return architectures[config.architecture]


@torch.inference_mode()
def load_model(
    config: ModelConfig,
    platform: Platform,
    *,
    block_size: int,
    device: Union[str, torch.device],
    tp: TPGroup = TPGroup(),
    quantization: Optional[str] = None,
    model_cls: Optional[type] = None,
) -> nn.Module:
    """Construct the model on ``device`` in ``config.dtype`` and load every checkpoint tensor,
    then hand its MoE layers to the platform's fused MoE and quantise its linear layers when
    ``quantization`` (``"fp8"``, ``"int8"``; not for MoE models) is given. A
    GGUF file's linear layers stay in their quantized types where the platform has kernels for
    them (``octavo.quantization.quantized_linear``), the rest are dequantized.

    A tensor the model needs but the checkpoint lacks, or one of the wrong shape, is a
    ConfigError naming it.
    """
    check_quantization(quantization)
    cls = model_cls or model_class(config, platform)
    model = cls(config, platform, block_size=block_size, device=device, tp=tp)
    if quantization is not None and any(isinstance(m, FusedExperts) for m in model.modules()):
        raise ConfigError(
            f"--quantization {quantization} does not cover Mixture-of-Experts weights yet "
            f"({config.architecture}'s experts would stay in {config.dtype}): drop it"
        )
    kept: dict = {}
    if config.is_gguf:
        if quantization is not None:
            raise ConfigError(
                f"{str(config.model_path)!r} is a GGUF file, quantized already: drop "
                f"--quantization {quantization} (it applies to safetensors checkpoints)"
            )
        checkpoint = GgufCheckpoint(config.model_path, dict(config.hf_config))
        kept = keep_quantized(model, checkpoint, platform, tp.size)
        tensors = checkpoint.iterate(model.checkpoint_tensor_names())
    else:
        tensors = iterate_checkpoint(config.model_path)
    consumed = model.load_weights(tensors)
    missing = sorted(model.checkpoint_tensor_names() - consumed)
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ConfigError(
            f"the checkpoint in {str(config.model_path)!r} "
            f"is missing {len(missing)} tensor(s) that "
            f"{config.architecture} needs: {shown}"
        )
    pack_experts(model, platform)
    attach_quantized(kept, platform)
    if config.is_gguf:
        keep_lm_head_quantized(model, checkpoint, platform, tp.size)
    if quantization == "int8":
        return quantize_int8(model, platform).eval()
    return quantize_model(model, platform, quantization).eval()
