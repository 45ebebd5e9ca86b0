"""What a local HuggingFace model folder says about the model, checked and normalised."""

from __future__ import annotations

import dataclasses
import json
import re
import types
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from octavo.errors import ConfigError
from octavo.models.layers.rotary import RopeConfig, parse_rope_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model_folder(model: Union[str, Path]) -> Path:
    """The model folder as a resolved path, or a ConfigError saying what is wrong with it."""
    path = Path(model).expanduser()
    if not path.exists():
        if _HUB_ID.match(str(model)) and not str(model).startswith("."):
            raise ConfigError(
                f"{str(model)!r} looks like a HuggingFace Hub id, but no such local folder exists; "
                f"octavo loads models from local folders only (no network): download it first, "
                f"e.g. `huggingface-cli download {model} --local-dir ./{Path(str(model)).name}`, "
                f"and pass that folder"
            )
        raise ConfigError(f"model folder {str(model)!r} does not exist")
    if not path.is_dir():
        raise ConfigError(
            f"model path {str(model)!r} is neither a folder nor a .gguf file; pass the "
            "HuggingFace model folder or a GGUF file"
        )
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model folder {str(path)!r} has no config.json; a HuggingFace model folder holds "
            "config.json, model.safetensors (or model.safetensors.index.json) "
            "and the tokenizer files (or pass a GGUF file, or a folder holding just one)"
        )
    return path.resolve()


def read_model_configs(model: Union[str, Path]) -> tuple[Path, dict, dict]:
    """``(path, config.json, generation_config.json)`` of a model folder, or of a GGUF file
    (``path`` the file; the two dicts from its metadata)."""
    from octavo.quantization.gguf_file import gguf_file, gguf_hf_config

    gguf = gguf_file(model)
    if gguf is not None:
        hf, generation = gguf_hf_config(gguf)
        return gguf, hf, generation
    path = resolve_model_folder(model)
    generation_file = path / "generation_config.json"
    generation = read_json(generation_file) if generation_file.is_file() else {}
    return path, read_json(path / "config.json"), generation


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file as a dict, or a ConfigError naming the file."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {str(path)!r}: {exc}") from exc


def resolve_dtype(
    requested: Union[str, torch.dtype],
    hf_config: Mapping[str, Any],
    supported: Sequence[torch.dtype],
    platform_name: str,
) -> torch.dtype:
    """``auto`` means the checkpoint's dtype (falling back to a supported one); an explicit
    dtype the platform does not offer is a ConfigError listing what it does offer."""
    names = ", ".join(str(d).removeprefix("torch.") for d in supported)
    if isinstance(requested, torch.dtype):
        dtype = requested
    elif requested == "auto":
        stored = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
        dtype = DTYPES.get(str(stored).removeprefix("torch."), torch.float32)
        if dtype not in supported:
            dtype = next(
                (d for d in (torch.bfloat16, torch.float32) if d in supported), supported[0]
            )
        return dtype
    elif requested in DTYPES:
        dtype = DTYPES[requested]
    else:
        raise ConfigError(f"unknown dtype {requested!r}; choose one of auto, {', '.join(DTYPES)}")
    if dtype not in supported:
        raise ConfigError(
            f"dtype {str(dtype).removeprefix('torch.')} is not supported by platform "
            f"{platform_name!r} (it offers: {names}); pass --dtype with one of those"
        )
    return dtype


def _eos_token_ids(
    hf_config: Mapping[str, Any], generation_config: Mapping[str, Any]
) -> tuple[int, ...]:
    eos = generation_config.get("eos_token_id", hf_config.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only model's shape, dtype and special tokens, read from its folder."""

    model_path: Path
    architecture: str
    dtype: torch.dtype
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    max_model_len: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    hf_config: Mapping[str, Any] = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )
    generation_config: Mapping[str, Any] = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def is_gguf(self) -> bool:
        """Whether the checkpoint is a GGUF file (``model_path`` the file)."""
        return self.model_path.is_file()

    def __reduce__(self):  # to a tensor-parallel worker: the read-only views go as dicts
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["hf_config"] = dict(self.hf_config)
        fields["generation_config"] = dict(self.generation_config)
        return (_rebuild, (fields,))

    @classmethod
    def from_folder(
        cls,
        model: Union[str, Path],
        *,
        dtype: Union[str, torch.dtype] = "auto",
        supported_dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16, torch.float16),
        platform_name: str = "this platform",
        max_model_len: Optional[int] = None,
    ) -> "ModelConfig":
        """Read ``config.json`` (and ``generation_config.json`` when present) from ``model``, or
        the metadata of a GGUF file (``model`` the file, or a folder holding just one)."""
        path, hf, generation = read_model_configs(model)
        config_file = str(path) if path.is_file() else str(path / "config.json")
        architectures = hf.get("architectures") or []
        if len(architectures) != 1:
            raise ConfigError(
                f"{config_file!r} must name exactly one architecture, got {architectures!r}"
            )
        missing = [
            k
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "vocab_size",
                "intermediate_size",
            )
            if k not in hf
        ]
        if missing:
            raise ConfigError(f"{config_file!r} lacks {', '.join(missing)}")
        heads = int(hf["num_attention_heads"])
        max_pos = int(hf.get("max_position_embeddings", 2048))
        if max_model_len is not None and max_model_len > max_pos:
            raise ConfigError(
                f"max_model_len {max_model_len} exceeds the model's "
                f"max_position_embeddings ({max_pos})"
            )
        return cls(
            model_path=path,
            architecture=architectures[0],
            dtype=resolve_dtype(dtype, hf, supported_dtypes, platform_name),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            vocab_size=int(hf["vocab_size"]),
            max_position_embeddings=max_pos,
            max_model_len=max_model_len or max_pos,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=parse_rope_config(hf, layer_type="full_attention"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            hidden_act=str(hf.get("hidden_act", "silu")),
            bos_token_id=generation.get("bos_token_id", hf.get("bos_token_id")),
            eos_token_ids=_eos_token_ids(hf, generation),
            hf_config=types.MappingProxyType(hf),
            generation_config=types.MappingProxyType(generation),
        )


def _rebuild(fields: dict[str, Any]) -> ModelConfig:
    fields["hf_config"] = types.MappingProxyType(fields["hf_config"])
    fields["generation_config"] = types.MappingProxyType(fields["generation_config"])
    return ModelConfig(**fields)
