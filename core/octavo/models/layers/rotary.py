"""Rotary position embeddings (HF ``rotate_half`` layout) and the rope configurations they
accept."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Union

import torch
from torch import nn

from octavo.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """RoPE base and scaling, normalised from either config format (see
    :func:`parse_rope_config`)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: Optional[int] = None
    # YaRN (DeepSeek, Qwen long-context): the ramp's bounds, the mscales, an explicit factor
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None
    truncate: bool = True

    @property
    def cos_sin_factor(self) -> float:
        """What the cos/sin tables are multiplied by: YaRN's attention factor, else 1."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)

    def softmax_scale_factor(self) -> float:
        """DeepSeek's (MLA's) extra softmax scale under scaled RoPE: ``mscale(factor,
        mscale_all_dim) ** 2`` when ``mscale_all_dim`` is set, else 1."""
        if self.rope_type == "default" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def parse_rope_config(hf_config: Mapping[str, Any], layer_type: Optional[str] = None) -> RopeConfig:
    """Read RoPE settings from a HF ``config.json`` dict.

    transformers 5 writes ``rope_parameters`` (with ``rope_theta`` inside); 4.x wrote
    ``rope_theta`` and ``rope_scaling`` (type under ``rope_type`` or the older ``type``). Both are
    accepted. A model with per-layer-type settings (Gemma 3: ``{"full_attention": {...},
    "sliding_attention": {...}}``) is read for ``layer_type``. Scaling types other than linear,
    llama3 and yarn raise :class:`ConfigError`.
    """
    params = hf_config.get("rope_parameters")
    if params is None:
        params = dict(hf_config.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    elif any(isinstance(v, Mapping) for v in params.values()):
        if not isinstance(params.get(layer_type), Mapping):
            raise ConfigError(
                f"rope_parameters are per layer type ({', '.join(params)}); "
                f"this model reads them for {layer_type!r}, which they lack"
            )
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"rope scaling type {rope_type!r} is not supported; supported types: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    theta = float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return RopeConfig("default", theta)
    if rope_type == "yarn":
        return _yarn_config(params, theta, hf_config)
    if "factor" not in params:
        raise ConfigError(f"rope scaling type {rope_type!r} needs a 'factor' in the model config")
    if rope_type == "linear":
        return RopeConfig("linear", theta, factor=float(params["factor"]))
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise ConfigError("llama3 rope scaling needs 'original_max_position_embeddings'")
    return RopeConfig(
        "llama3",
        theta,
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
    )


def _yarn_config(params: Mapping[str, Any], theta: float, hf_config) -> RopeConfig:
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise ConfigError("yarn rope scaling needs 'original_max_position_embeddings'")
    factor = params.get("factor")
    if factor is None:  # DeepSeek-V3's: the ratio of the two lengths
        factor = hf_config.get("max_position_embeddings", original) / original
    optional = {k: params.get(k) for k in ("mscale", "mscale_all_dim", "attention_factor")}
    return RopeConfig(
        "yarn",
        theta,
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        **{k: None if v is None else float(v) for k, v in optional.items()},
    )


def _yarn_scale(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    """YaRN: interpolated frequencies (``/ factor``) below the ramp, extrapolated ones above
    it, a linear ramp between the dimensions where ``beta_slow`` and ``beta_fast`` rotations
    fit in the original context (as transformers computes them)."""

    def correction_dim(rotations: float) -> float:
        length = rope.original_max_position_embeddings
        return (
            rotary_dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation


def inverse_frequencies(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    """The ``rotary_dim // 2`` inverse frequencies, as transformers computes them (float32)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn_scale(rope, rotary_dim)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by ``factor``, short ones kept, a smooth
    interpolation in between."""
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Cos/sin tables for every position below ``max_position``.

    The tables are float32, cast to the activations' dtype per step; the platform's
    ``rotary_embedding`` (``octavo.ops.reference.rotary_embedding`` or its own kernel) then
    computes ``x * cos + rotate_half(x) * sin`` in that dtype: the same arithmetic as
    transformers, so bfloat16 results agree with it bit for bit.
    """

    def __init__(
        self, head_dim: int, max_position: int, rope: RopeConfig, device: Union[str, torch.device]
    ):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = inverse_frequencies(rope, head_dim)
        positions = torch.arange(max_position, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        factor = rope.cos_sin_factor
        self.register_buffer("cos_cache", (emb.cos() * factor).to(device), persistent=False)
        self.register_buffer("sin_cache", (emb.sin() * factor).to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """``(cos, sin)`` of shape ``[T, 1, head_dim]`` in ``dtype``, computed once per step."""
        cos = self.cos_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin
