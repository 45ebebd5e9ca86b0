"""The engine's tokenizer: the ``tokenizers`` backend on the request path, transformers when asked.

Importing transformers costs about a second of start-up (5.x builds its lazy-import table from
the sources of every model module at each import), yet encoding a prompt and decoding tokens
need only the fast tokenizer's Rust backend. The first time a model's tokenizer is loaded,
transformers loads it and what the engine needs of it is written to a cache file: the backend as
transformers configured it (its post-processor, added tokens), the special ids and the chat
template. Later starts read that file and build the backend alone; transformers is imported the
first time something needs it (a chat template rendered, a grammar compiled,
``LLM.get_tokenizer()``).

The cache key is every file of the model folder a tokenizer may read and the versions of
transformers and tokenizers, so a changed file or library is a miss. A tokenizer whose class
changes how it encodes or decodes (a slow tokenizer, a class overriding transformers' fast
encode/decode, space clean-up on decode) is never cached: it is loaded by transformers every time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import tokenizers

from octavo.errors import ConfigError
from octavo.model_executor.model_config import read_json, resolve_model_folder
from octavo.quantization.gguf_file import gguf_file

logger = logging.getLogger("octavo.tokenizer")

DEFAULT_CACHE_DIR = Path("~/.cache/octavo/tokenizers")
CACHE_FORMAT = 1
CHAT_TEMPLATES_DIR = "additional_chat_templates"  # transformers' folder of named templates
WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5"})
"""Files of a model folder no tokenizer reads (the rest are hashed into the cache key)."""

GENERIC_TOKENIZER_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
"""``tokenizer_class`` names of transformers' generic ``tokenizer.json`` tokenizer (one class under
both names), which ``AutoTokenizer`` would resolve to as well."""


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
    """What the engine reads of a transformers fast tokenizer, besides its backend."""

    backend_json: str
    eos_token_id: Optional[int]
    bos_token_id: Optional[int]
    all_special_ids: tuple[int, ...]
    chat_template: Any  # str, a dict of named templates, or None
    split_special_tokens: bool


class Tokenizer:
    """A model's tokenizer: ``encode``/``decode`` and the special ids through the ``tokenizers``
    backend, everything else through the transformers tokenizer (``hf``), loaded when first
    needed. Both tokenize alike: the backend is the one transformers built for this folder."""

    def __init__(self, path: Path, info: TokenizerInfo, hf: Any = None) -> None:
        self.path = path
        self.info = info
        self._backend = tokenizers.Tokenizer.from_str(info.backend_json)
        # transformers encodes with truncation and padding off unless asked, and sets the backend's
        # special-token splitting from its own flag on every call.
        self._backend.no_truncation()
        self._backend.no_padding()
        self._backend.encode_special_tokens = info.split_special_tokens
        self._hf = hf
        self._lock = threading.Lock()

    def __reduce__(self):  # to a tensor-parallel worker: the cached part; ``hf`` loads there
        return (Tokenizer, (self.path, self.info))

    @property
    def backend_tokenizer(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def eos_token_id(self) -> Optional[int]:
        return self.info.eos_token_id

    @property
    def bos_token_id(self) -> Optional[int]:
        return self.info.bos_token_id

    @property
    def all_special_ids(self) -> list[int]:
        return list(self.info.all_special_ids)

    @property
    def chat_template(self) -> Any:
        return self.info.chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        """transformers' ``apply_chat_template`` (it renders with its own Jinja environment)."""
        return self.hf.apply_chat_template(conversation, **kwargs)

    @property
    def hf(self) -> Any:
        """The transformers tokenizer of this folder (imported and loaded on first use)."""
        with self._lock:
            if self._hf is None:
                self._hf = load_hf_tokenizer(self.path)
            return self._hf


def load_tokenizer(
    model: Union[str, Path], cache_dir: Optional[Union[str, Path]] = None
) -> Union[Tokenizer, Any]:
    """The model's tokenizer: a ``Tokenizer`` built from the cache when this folder's tokenizer was
    cached before (no transformers import), else loaded by transformers and cached if it can be.
    A tokenizer that cannot be cached is returned as transformers loads it.

    ``cache_dir``: where the cache files live (default ``~/.cache/octavo/tokenizers``).
    ``model`` may be a GGUF file (or a folder holding one): its tokenizer is the one
    transformers builds from the file's metadata."""
    path = tokenizer_source(model)
    cache_file = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / f"{cache_key(path)}.json"
    cached = _cached_tokenizer(path, cache_file)
    if cached is not None:
        return cached
    hf = load_hf_tokenizer(path)
    info = info_of(hf)
    if info is None:
        return hf
    _write_cache(cache_file, info)
    return Tokenizer(path, info, hf)


def check_vocabulary(tokenizer: Any, vocab_size: int, source: Union[str, Path]) -> None:
    """A ConfigError when the tokenizer of ``source`` has more tokens than the model's
    vocabulary (a ``--tokenizer`` of another model): its ids would index past the embedding."""
    if isinstance(tokenizer, Tokenizer):
        size = tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    else:
        size = len(tokenizer)
    if size > vocab_size:
        raise ConfigError(
            f"the tokenizer of {str(source)!r} has {size} tokens, more than the model's "
            f"vocabulary of {vocab_size}: it is another model's tokenizer; pass the one that "
            "came with the model (--tokenizer FOLDER), or leave --tokenizer out"
        )


def tokenizer_source(model: Union[str, Path]) -> Path:
    """The model folder, or the GGUF file, that ``model`` names."""
    return gguf_file(model) or resolve_model_folder(model)


def load_hf_tokenizer(model: Union[str, Path]) -> Any:
    """The model's tokenizer, as transformers ``AutoTokenizer`` loads it (local files only).

    A folder whose ``tokenizer_config.json`` names the generic ``tokenizer.json`` class is loaded
    by that class directly: the same tokenizer, without ``AutoTokenizer`` first reading the model
    config, which imports the model's transformers modules (seconds of start-up)."""
    path = tokenizer_source(model)
    try:
        if path.is_file():  # a GGUF file: transformers converts the tokenizer in its metadata
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        if _names_generic_tokenizer(path):
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many types; the user needs the reason
        raise ConfigError(f"cannot load the tokenizer from {str(path)!r}: {exc}") from exc


def _names_generic_tokenizer(path: Path) -> bool:
    """Whether ``path`` holds a ``tokenizer.json`` whose config names the generic class (and no
    remote code of its own)."""
    config_file = path / "tokenizer_config.json"
    if not (path / "tokenizer.json").is_file() or not config_file.is_file():
        return False
    config = read_json(config_file)
    return config.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES and "auto_map" not in config


def info_of(hf: Any) -> Optional[TokenizerInfo]:
    """What to cache of a transformers tokenizer, or None when its ``encode``/``decode`` are not
    its backend's: a slow tokenizer, a class that overrides the fast tokenizer's encode or
    decode, or one that cleans up spaces after decoding."""
    from transformers import PreTrainedTokenizerFast

    if not isinstance(hf, PreTrainedTokenizerFast) or hf.clean_up_tokenization_spaces:
        return None
    methods = ("encode", "_encode_plus", "decode", "_decode", "set_truncation_and_padding")
    if any(getattr(type(hf), m) is not getattr(PreTrainedTokenizerFast, m) for m in methods):
        return None
    return TokenizerInfo(
        backend_json=hf.backend_tokenizer.to_str(),
        eos_token_id=hf.eos_token_id,
        bos_token_id=hf.bos_token_id,
        all_special_ids=tuple(hf.all_special_ids),
        chat_template=hf.chat_template,
        split_special_tokens=bool(hf.split_special_tokens),
    )


def cache_key(path: Path) -> str:
    """A digest of the versions of the tokenizer libraries, the cache format and every file of
    ``path`` a tokenizer may read (those of the folder and of its named chat templates, all but
    the weights)."""
    digest = hashlib.sha256()
    for library in ("transformers", "tokenizers"):
        digest.update(f"{library}={_version(library)}\n".encode())
    digest.update(f"format={CACHE_FORMAT}\n".encode())
    if path.is_file():  # a GGUF file (too large to hash at each start): its identity and age
        stat = path.stat()
        digest.update(f"{path}\n{stat.st_size}\n{stat.st_mtime_ns}\n".encode())
        return digest.hexdigest()
    files = [*path.iterdir(), *(path / CHAT_TEMPLATES_DIR).glob("*")]
    for file in sorted(p for p in files if p.is_file()):
        if file.suffix not in WEIGHT_SUFFIXES:
            digest.update(f"{file.relative_to(path)}\n".encode())
            digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def hf_tokenizer(tokenizer: Any) -> Any:
    """The transformers tokenizer behind what ``load_tokenizer`` returned."""
    return tokenizer.hf if isinstance(tokenizer, Tokenizer) else tokenizer


def _cached_tokenizer(path: Path, cache_file: Path) -> Optional[Tokenizer]:
    """The tokenizer built from its cache file, or None when there is none or it cannot be used
    (it is rewritten)."""
    try:
        fields = json.loads(cache_file.read_text())
        fields["all_special_ids"] = tuple(fields["all_special_ids"])
        return Tokenizer(path, TokenizerInfo(**fields))
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - a damaged cache file is a miss, never an error
        logger.warning("ignoring the tokenizer cache file %s (%s); rebuilding it", cache_file, exc)
        return None


def _write_cache(cache_file: Path, info: TokenizerInfo) -> None:
    """Write ``info`` atomically; a cache that cannot be written only costs the next start-up."""
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", dir=cache_file.parent, suffix=".tmp", delete=False
        ) as f:
            json.dump(dataclasses.asdict(info), f)
        os.replace(f.name, cache_file)
    except OSError as exc:
        logger.info("cannot write the tokenizer cache %s (%s)", cache_file, exc)
