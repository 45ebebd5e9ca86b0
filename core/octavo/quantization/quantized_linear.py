"""Linear layers over weights kept quantized: a GGUF file's blocks, or ``--quantization int8``.

A layer kept quantized holds its weight as raw rows (``uint8 [N, row_bytes]``, see
:mod:`octavo.quantization.quant_types`) and multiplies through the platform's kernel for its
type (``octavo_quantized_linear_packer``), packed once at load; its bias stays in the model
dtype. Where the platform has no kernel for a type the weight is dequantized once, at load, to
the model dtype (a GGUF file), or the request is refused (``--quantization int8``).
"""

from __future__ import annotations

import collections
import logging
from typing import Callable, Optional

import torch
from torch import nn

from octavo.errors import ConfigError
from octavo.models.layers.embedding import ParallelLMHead
from octavo.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from octavo.platform.facade import Platform
from octavo.quantization.quant_types import INT8, row_bytes

logger = logging.getLogger(__name__)

Product = Callable[[torch.Tensor], torch.Tensor]
LINEARS = (ColumnParallelLinear, RowParallelLinear)


def in_features(layer: nn.Module) -> int:
    """The input width of ``layer``'s weight on this rank."""
    return layer.input_shard if isinstance(layer, RowParallelLinear) else layer.input_size


class QuantizedMatmul:
    """A linear layer's ``QuantMethod`` over its quantized rows: the platform's product per row
    range (the whole weight, or each part of a merged one), packed at load."""

    def __init__(self, layer: nn.Module, quant_type: str, pack) -> None:
        self.quant_type = quant_type
        self._pack = pack
        self._products: dict[tuple[int, int], Product] = {}
        ranges = [(0, layer.weight.shape[0])]
        if isinstance(layer, MergedColumnParallelLinear):
            ranges = list(zip(layer.shard_offsets, layer.shard_sizes))
        for start, size in ranges:
            self._products[(start, size)] = self._packed(layer, start, size)

    def _packed(self, layer: nn.Module, start: int, size: int) -> Product:
        raw = layer.weight.detach().narrow(0, start, size).contiguous()
        return self._pack(raw, in_features(layer))

    def product_for(self, start: int, size: int) -> Optional[Product]:
        """The packed product of the weight's rows ``start .. start + size`` (None: not packed
        yet)."""
        return self._products.get((start, size))

    def apply(
        self, layer: nn.Module, x: torch.Tensor, start: int, size: int, bias: Optional[torch.Tensor]
    ) -> torch.Tensor:
        product = self._products.get((start, size))
        if product is None:  # a row range not packed at load (a merged weight whole): once now
            product = self._products[(start, size)] = self._packed(layer, start, size)
        if x.dtype != torch.float32:  # the kernels take float32: the bias added before rounding
            out = product(x.float())
            return (out if bias is None else out + bias).to(x.dtype)
        out = product(x)
        return out if bias is None else out + bias


def checkpoint_names(model: nn.Module, module_name: str) -> list[str]:
    """The checkpoint tensors a linear layer's weight is loaded from (its fused parts)."""
    name = f"{module_name}.weight"
    fused = [name.replace(p, c) for p, c, _ in model.STACKED_PARAMS if p in name]
    return fused or [name]


def raw_row_loader(layer: nn.Module) -> Callable:
    """A weight loader that copies a GGUF tensor's raw rows into ``layer``'s quantized weight
    (its part ``shard_id`` at that part's rows, as the float loader places values)."""

    def load(param: torch.Tensor, loaded, shard_id=None) -> None:
        if loaded.shape[1] != in_features(layer):
            raise ValueError(
                f"has {loaded.shape[1]} columns but the model config implies {in_features(layer)}"
            )
        if isinstance(layer, RowParallelLinear):
            param.data.copy_(loaded.raw_rows())
            return
        index = layer._shard_index(shard_id)
        start, rows = layer.shard_starts[index], layer.shard_sizes[index]
        if loaded.shape[0] != layer.output_sizes[index]:
            raise ValueError(
                f"has {loaded.shape[0]} rows but the model config implies "
                f"{layer.output_sizes[index]}"
            )
        param.data.narrow(0, layer.shard_offsets[index], rows).copy_(loaded.raw_rows(start, rows))

    return load


def _quantized_weight(layer: nn.Module, quant_type: str) -> nn.Parameter:
    shape = (layer.weight.shape[0], row_bytes(quant_type, in_features(layer)))
    param = nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)
    param.weight_loader = raw_row_loader(layer)
    return param


def keep_quantized(model: nn.Module, checkpoint, platform: Platform, tp_size: int) -> dict:
    """Give each linear layer whose GGUF tensors share a type the platform multiplies natively a
    raw-row weight to load them into (before loading); return ``{layer: quant_type}``. The other
    layers load dequantized values. Logs what became of each type."""
    kept: dict[nn.Module, str] = {}
    dequantized: collections.Counter = collections.Counter()
    for module_name, layer in model.named_modules():
        if not isinstance(layer, LINEARS):
            continue
        names = checkpoint_names(model, module_name)
        present = [checkpoint.tensor(n) for n in names if checkpoint.gguf_name(n)]
        if not present or all(t.is_float for t in present):
            continue
        types = {t.quant_type for t in present}
        quant_type = next(iter(types)) if len(types) == 1 else None  # mixed parts: dequantized
        if tp_size == 1 and quant_type and platform.quantized_linear_packer(quant_type):
            layer.weight = _quantized_weight(layer, quant_type)
            kept[layer] = quant_type
        else:
            dequantized.update(t.quant_type for t in present if not t.is_float)
    log_tensor_fates(checkpoint, kept, dequantized, tp_size, model.config.dtype)
    return kept


def log_tensor_fates(checkpoint, kept: dict, dequantized, tp_size: int, dtype) -> None:
    """One log line: the file's tensor types, and which were kept quantized or dequantized (a
    warning when linear weights were: the model then takes more memory than the file)."""
    kept_types = collections.Counter(kept.values())
    why = " (tensor parallelism: no quantized kernels)" if tp_size > 1 else ""
    log = logger.warning if dequantized else logger.info
    log(
        "GGUF %s: tensor types %s; linear weights kept quantized (native kernels): %s; "
        "dequantized to %s at load%s: %s (and the embedding, norms and biases)",
        checkpoint.path.name,
        _counts(checkpoint.type_counts()),
        _counts(kept_types) or "none",
        str(dtype).removeprefix("torch."),
        why,
        _counts(dequantized) or "none",
    )


def _counts(counter) -> str:
    return ", ".join(f"{t} x{n}" for t, n in sorted(counter.items()))


def keep_lm_head_quantized(model: nn.Module, checkpoint, platform: Platform, tp_size: int):
    """Give the LM head the platform's product over the GGUF rows of its weight (the embedding's
    when tied) where it has a kernel for their type: a decode step streams the head's weight once
    a token, and float32 would read 4x the bytes of Q8_0. Returns the type kept, or None."""
    head = next((m for m in model.modules() if isinstance(m, ParallelLMHead)), None)
    tied = model.config.tie_word_embeddings
    name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    if head is None or tp_size != 1 or checkpoint.gguf_name(name) is None:
        return None
    tensor = checkpoint.tensor(name)
    pack = None if tensor.is_float else platform.quantized_linear_packer(tensor.quant_type)
    if pack is None:
        return None
    head.packed = pack(tensor.raw_rows(), tensor.shape[1])
    logger.info(
        "GGUF %s: the LM head multiplies its %s rows", checkpoint.path.name, tensor.quant_type
    )
    return tensor.quant_type


def attach_quantized(kept: dict, platform: Platform) -> None:
    """Pack each kept layer's loaded rows for the platform's kernel (after loading)."""
    for layer, quant_type in kept.items():
        layer.quant_method = QuantizedMatmul(
            layer, quant_type, platform.quantized_linear_packer(quant_type)
        )


def int8_rows(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` -> ``int8`` rows (``uint8 [N, K + 4]``): symmetric per-output-channel,
    ``scale = amax(|row|) / 127`` (an all-zero row gets scale 1), values rounded to nearest."""
    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return torch.cat([values.view(torch.uint8), scale.view(torch.uint8)], dim=1)


def quantize_int8(model: nn.Module, platform: Platform) -> nn.Module:
    """``--quantization int8``: every linear layer of the decoder (not the embedding or the LM
    head) kept as int8 rows, multiplied by the platform's int8 kernel."""
    pack = platform.quantized_linear_packer(INT8)
    if pack is None:
        raise ConfigError(
            f"platform {platform.name!r} has no int8 weight kernel here, so --quantization int8 "
            "cannot run (on the cpu platform it needs the compiled kernels: see `octavo env`); "
            "drop --quantization, or serve a GGUF file"
        )
    for layer in [m for m in model.modules() if isinstance(m, LINEARS)]:
        if layer.quant_method is not None:
            continue
        raw = int8_rows(layer.weight.data)
        layer.weight = nn.Parameter(raw, requires_grad=False)
        layer.quant_method = QuantizedMatmul(layer, INT8, pack)
    return model
