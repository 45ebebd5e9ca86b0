"""A PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``), read
and checked against the base model before anything is loaded into a slot.

``check_adapter`` reads the config and the tensors' shapes only (the safetensors header), for
the engine to refuse a wrong adapter at once; ``load_adapter`` reads the weights too, for the
model runner. Every problem is a ``ConfigError`` naming the file and what to do.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from octavo.errors import ConfigError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may adapt (attention and MLP of every decoder layer)."""
_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)
_UNSUPPORTED_OPTIONS = {  # option: (value that is fine, why it is refused otherwise)
    "use_dora": (False, "DoRA adapters are not supported; merge it or train plain LoRA"),
    "fan_in_fan_out": (False, "fan_in_fan_out (Conv1D-style) weights are not supported"),
    "bias": ("none", "adapters that train biases are not supported (bias must be 'none')"),
}


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    """What an adapter folder declares: its rank, scaling and the modules it adapts."""

    path: Path
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    shapes: dict[str, tuple[int, ...]]  # tensor name -> shape, from the safetensors header


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    """An adapter's weights: ``weights[(layer, module)] = (A [r, in], B [out, r] * scaling)``,
    on the host in the base model's dtype."""

    spec: AdapterSpec
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def rank(self) -> int:
        return self.spec.rank

    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _read_config(folder: Path) -> dict[str, Any]:
    file = folder / CONFIG_FILE
    if not folder.is_dir():
        raise ConfigError(f"LoRA adapter {str(folder)!r} is not a folder: give a PEFT folder")
    if not file.is_file():
        raise ConfigError(f"LoRA adapter {str(folder)!r} has no {CONFIG_FILE}: not a PEFT folder")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{file} must hold a JSON object")
    return config


def _check_options(config: dict[str, Any], file: Path) -> None:
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ConfigError(f"{file}: peft_type {peft_type!r} is not LoRA")
    for option, (fine, why) in _UNSUPPORTED_OPTIONS.items():
        if config.get(option, fine) not in (fine, None):
            raise ConfigError(f"{file}: {why} (it sets {option}={config[option]!r})")
    if config.get("modules_to_save"):
        raise ConfigError(
            f"{file}: modules_to_save {config['modules_to_save']!r} (fully trained copies of base "
            "layers) are not supported; only LoRA matrices of "
            f"{', '.join(TARGET_MODULES)} are"
        )
    for option in ("rank_pattern", "alpha_pattern"):
        if config.get(option):
            raise ConfigError(f"{file}: per-module ranks or alphas ({option}) are not supported")


def _scaling(config: dict[str, Any], rank: int, file: Path) -> float:
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise ConfigError(f"{file}: lora_alpha must be a positive number; got {alpha!r}")
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _tensor_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import SafetensorError, safe_open

    file = folder / WEIGHTS_FILE
    if not file.is_file():
        found = "adapter_model.bin" if (folder / "adapter_model.bin").is_file() else "nothing"
        raise ConfigError(
            f"LoRA adapter {str(folder)!r} has no {WEIGHTS_FILE} (found {found}): save it with "
            "PEFT's save_pretrained(..., safe_serialization=True)"
        )
    try:
        with safe_open(str(file), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigError(f"{file} cannot be read as safetensors: {exc}") from None


def module_shapes(model_config) -> dict[str, tuple[int, int]]:
    """Each adaptable projection's ``(in, out)`` in the base model."""
    mc = model_config
    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    hidden, inner = mc.hidden_size, mc.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inner),
        "up_proj": (hidden, inner),
        "down_proj": (inner, hidden),
    }


def check_adapter(path: str, model_config, max_lora_rank: int) -> AdapterSpec:
    """The adapter at ``path`` if it fits the base model (layers, projections, shapes) and its
    rank is at most ``max_lora_rank``; else a ConfigError saying what does not fit."""
    folder = Path(path).expanduser()
    config = _read_config(folder)
    file = folder / CONFIG_FILE
    _check_options(config, file)
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"{file}: r (the rank) must be a positive integer; got {rank!r}")
    if rank > max_lora_rank:
        raise ConfigError(
            f"LoRA adapter {str(folder)!r} has rank {rank}, above --max-lora-rank "
            f"{max_lora_rank}: raise --max-lora-rank to at least {rank}"
        )
    shapes = _tensor_shapes(folder)
    targets = _check_shapes(shapes, folder, model_config, rank)
    return AdapterSpec(folder, rank, _scaling(config, rank, file), targets, shapes)


def _check_shapes(shapes, folder: Path, model_config, rank: int) -> tuple[str, ...]:
    expected = module_shapes(model_config)
    targets: set[str] = set()
    seen: set[tuple[int, str, str]] = set()
    for name, shape in shapes.items():
        match = _TENSOR_NAME.match(name)
        if match is None:
            raise ConfigError(
                f"LoRA adapter {str(folder)!r}: tensor {name!r} is not a LoRA matrix of a "
                f"decoder layer's {', '.join(TARGET_MODULES)}; such adapters are not supported"
            )
        layer, module, which = int(match[1]), match[2], match[3]
        if module not in expected:
            raise ConfigError(
                f"LoRA adapter {str(folder)!r} adapts {module!r}; supported: "
                f"{', '.join(TARGET_MODULES)}"
            )
        if layer >= model_config.num_hidden_layers:
            raise ConfigError(
                f"LoRA adapter {str(folder)!r} adapts layer {layer}, but the base model has "
                f"{model_config.num_hidden_layers} layers: it was trained for another model"
            )
        size_in, size_out = expected[module]
        want = (rank, size_in) if which == "A" else (size_out, rank)
        if shape != want:
            raise ConfigError(
                f"LoRA adapter {str(folder)!r}: {name} has shape {list(shape)} but this base "
                f"model and r={rank} imply {list(want)}: it was trained for another model"
            )
        targets.add(module)
        seen.add((layer, module, which))
    unpaired = {
        (layer, m) for layer, m, _ in seen if not {(layer, m, "A"), (layer, m, "B")} <= seen
    }
    if unpaired:
        raise ConfigError(
            f"LoRA adapter {str(folder)!r}: lora_A/lora_B unpaired at {sorted(unpaired)}"
        )
    if not targets:
        raise ConfigError(f"LoRA adapter {str(folder)!r} holds no LoRA matrices")
    return tuple(m for m in TARGET_MODULES if m in targets)


def load_adapter(path: str, model_config, max_lora_rank: int) -> LoRAAdapter:
    """The adapter's checked weights, ``B`` scaled, in the base model's dtype."""
    from safetensors.torch import load_file

    spec = check_adapter(path, model_config, max_lora_rank)
    tensors = load_file(str(spec.path / WEIGHTS_FILE))
    dtype = model_config.dtype
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR_NAME.match(name)
        pairs.setdefault((int(match[1]), match[2]), {})[match[3]] = tensor
    weights = {
        key: (ab["A"].to(dtype), (ab["B"].float() * spec.scaling).to(dtype))
        for key, ab in pairs.items()
    }
    return LoRAAdapter(spec, weights)
