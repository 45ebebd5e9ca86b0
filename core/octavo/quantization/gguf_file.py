"""GGUF checkpoints (llama.cpp's single-file format), read through the ``gguf`` package.

``octavo serve FILE.gguf`` (or a folder holding one ``.gguf`` and no ``config.json``) loads:

- the model's HuggingFace config from the file's metadata, as transformers' GGUF support maps
  it (``load_gguf_checkpoint(..., return_tensors=False)``), with the architecture named by
  ``general.architecture`` (:data:`ARCHITECTURES`);
- its tensors under HuggingFace names (``gguf``'s tensor-name map, run backwards over the names
  the model needs), each a :class:`GgufTensor`: read lazily from the memory-mapped file, in its
  GGUF type, and dequantized by the ``gguf`` package when a layer asks for float values;
- the tokenizer (``--tokenizer`` for a HuggingFace folder, else transformers' GGUF tokenizer;
  see ``octavo.model_executor.tokenizer``).

llama.cpp's converter stores a Llama's q and k projection rows permuted (its rotary embedding
rotates adjacent pairs, HuggingFace's rotates halves); :class:`GgufTensor` un-permutes them as a
row index, so the quantized bytes of each row stay as they are.
"""

from __future__ import annotations

import collections
import functools
import logging
from pathlib import Path
from typing import Iterator, Optional, Union

import numpy as np
import torch

from octavo.errors import ConfigError

logger = logging.getLogger(__name__)

SUFFIX = ".gguf"
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
"""transformers' ``model_type`` of a GGUF file -> the octavo model class's name."""
FILE_ARCHITECTURES = ("llama", "qwen2", "qwen3")
"""The ``general.architecture`` values octavo serves (llama.cpp writes Mistral as llama)."""
PERMUTED_QK = ("llama", "mistral")
"""Architectures whose q/k rows llama.cpp's converter permuted for its rotary embedding."""
FLOAT_TYPES = ("F32", "F16", "BF16")


def gguf_file(model: Union[str, Path, None]) -> Optional[Path]:
    """The GGUF file ``model`` names: a ``.gguf`` file, or a folder with no ``config.json`` and
    exactly one ``.gguf`` file. None when ``model`` is not a GGUF checkpoint."""
    if model is None:
        return None
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == SUFFIX:
        return path.resolve()
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob(f"*{SUFFIX}"))
    if len(files) > 1:
        raise ConfigError(
            f"model folder {str(path)!r} holds {len(files)} GGUF files "
            f"({', '.join(f.name for f in files)}); pass the path of the one to serve"
        )
    return files[0].resolve() if files else None


@functools.lru_cache(maxsize=4)
def open_gguf(path: Path):
    """The file's ``gguf.GGUFReader`` (memory-mapped), or a ConfigError naming the file when it
    is not a GGUF file or is cut short."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise ConfigError(
            f"{str(path)!r} is not a readable GGUF file ({type(exc).__name__}: {exc}); "
            "check that the download finished (a truncated file fails so) and that it is "
            "llama.cpp's GGUF format"
        ) from None


def gguf_hf_config(path: Path) -> tuple[dict, dict]:
    """``(config.json, generation_config.json)`` as dicts, from the file's metadata."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    fields = open_gguf(path).fields  # a file that is no GGUF fails here, with its name
    arch = (
        str(fields["general.architecture"].contents()) if "general.architecture" in fields else None
    )
    if arch not in FILE_ARCHITECTURES:
        raise ConfigError(
            f"{str(path)!r} holds a {arch!r} model; octavo serves GGUF files of these "
            f"architectures: {', '.join(FILE_ARCHITECTURES)} (Mistral is written as llama)"
        )
    try:
        config = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise ConfigError(f"cannot read the model config of {str(path)!r}: {exc}") from None
    config["architectures"] = [ARCHITECTURES[config["model_type"]]]
    key_length = fields.get(f"{arch}.attention.key_length")
    if key_length is not None:  # transformers maps it for some architectures only (not Qwen3)
        config["head_dim"] = int(key_length.contents())
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    return config, generation


class GgufTensor:
    """One tensor of the file under its HuggingFace orientation (``shape`` ``[rows, columns]``
    for a matrix): ``narrow`` gives float32 values (dequantized), ``raw_rows`` the GGUF bytes of
    whole rows (``uint8 [rows, row_bytes]``), each through ``row_index`` when the rows are
    permuted."""

    def __init__(self, data: np.ndarray, quant_type: str, shape: tuple[int, ...], row_index=None):
        self._data = data  # as the reader gives it: [rows, row_bytes] uint8, or float values
        self.quant_type = quant_type
        self.shape = torch.Size(shape)
        self._row_index = row_index
        self.elements_read = 0

    @property
    def is_float(self) -> bool:
        return self.quant_type in FLOAT_TYPES

    def _rows(self, start: int, length: int) -> np.ndarray:
        if self._data.ndim == 1:  # a vector (a norm's weight, a bias)
            return self._data[start : start + length]
        if self._row_index is None:
            return self._data[start : start + length]
        return self._data[self._row_index[start : start + length]]

    def raw_rows(self, start: int = 0, length: Optional[int] = None) -> torch.Tensor:
        """The GGUF bytes of rows ``start .. start + length`` (default: all)."""
        assert not self.is_float and self._data.ndim == 2
        length = self.shape[0] - start if length is None else length
        return torch.from_numpy(np.array(self._rows(start, length)))  # a copy: the map is read-only

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Float32 values of the slice (a quantized type dequantized by the ``gguf`` package)."""
        import gguf
        from gguf.quants import dequantize

        if dim == 0:
            rows = self._rows(start, length)
        else:
            rows = self._rows(0, self.shape[0])
        if self.is_float:
            values = np.asarray(rows, dtype=np.float32)
        else:
            values = dequantize(rows, gguf.GGMLQuantizationType[self.quant_type])
        out = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(
            (length, *self.shape[1:]) if dim == 0 else self.shape
        )
        if dim != 0:
            out = out.narrow(dim, start, length).contiguous()
        self.elements_read += out.numel()
        return out


def qk_row_index(rows: int, num_heads: int) -> np.ndarray:
    """HuggingFace row ``i`` of a q or k projection is GGUF row ``index[i]``: llama.cpp's
    converter interleaves each head's two rotary halves."""
    half = rows // num_heads // 2
    return np.arange(rows).reshape(num_heads, half, 2).transpose(0, 2, 1).reshape(rows)


class GgufCheckpoint:
    """The tensors of a GGUF file, found by the HuggingFace names a model asks for."""

    def __init__(self, path: Path, hf_config: dict):
        import gguf

        self.path = path
        self.reader = open_gguf(path)
        self.hf_config = hf_config
        arch_name = str(self.reader.fields["general.architecture"].contents())
        arch = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}.get(arch_name)
        if arch is None:
            raise ConfigError(f"{str(path)!r}: gguf does not know architecture {arch_name!r}")
        self.architecture = arch_name
        self.name_map = gguf.get_tensor_name_map(arch, int(hf_config["num_hidden_layers"]))
        self.tensors = {t.name: t for t in self.reader.tensors}

    def gguf_name(self, hf_name: str) -> Optional[str]:
        """The file's name for the HuggingFace tensor ``hf_name`` (None: no such tensor)."""
        name = self.name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        return name if name in self.tensors else None

    def type_counts(self) -> dict[str, int]:
        """How many tensors the file holds of each GGUF type."""
        return dict(collections.Counter(t.tensor_type.name for t in self.reader.tensors))

    def tensor(self, hf_name: str) -> GgufTensor:
        """The tensor ``hf_name`` (a KeyError when the file lacks it)."""
        name = self.gguf_name(hf_name)
        if name is None:
            raise KeyError(hf_name)
        raw = self.tensors[name]
        shape = tuple(int(n) for n in reversed(raw.shape.tolist()))  # GGUF lists dims inner first
        shape = tuple(n for n in shape if n != 1) if len(shape) > 2 else shape
        row_index = None
        if self.architecture in PERMUTED_QK and len(shape) == 2:
            heads = self._permuted_heads(name)
            if heads:
                row_index = qk_row_index(shape[0], heads)
        data = np.asarray(raw.data)
        if data.ndim == 2 and len(shape) == 1:
            data = data.reshape(-1)
        return GgufTensor(data, raw.tensor_type.name, shape, row_index)

    def _permuted_heads(self, gguf_name: str) -> int:
        if ".attn_q." in gguf_name:
            return int(self.hf_config["num_attention_heads"])
        if ".attn_k." in gguf_name:
            return int(self.hf_config["num_key_value_heads"])
        return 0

    def iterate(self, names: set[str]) -> Iterator[tuple[str, GgufTensor]]:
        """``(HuggingFace name, tensor)`` for each of ``names`` the file holds."""
        for name in sorted(names):
            if self.gguf_name(name) is not None:
                yield name, self.tensor(name)
