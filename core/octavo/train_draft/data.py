"""The text a draft head learns from: the files of a folder (or one file), split into training
and held-out files by a hash of each file's path, tokenized by the target's tokenizer and cut
into windows."""

from __future__ import annotations

import dataclasses
import hashlib
import random
from pathlib import Path
from typing import Sequence

import torch

HELD_OUT_BUCKETS = 20  # one file in twenty is held out: the demo model's own rule


def is_held_out(relative: Path) -> bool:
    """Whether a file (by its path relative to ``--data``) is held out (never trained on)."""
    digest = hashlib.sha256(relative.as_posix().encode("utf-8")).digest()
    return digest[0] % HELD_OUT_BUCKETS == 0


@dataclasses.dataclass(frozen=True)
class TextFiles:
    """The training and held-out files of ``root``, each sorted by relative path."""

    root: Path
    train: tuple[Path, ...]
    held_out: tuple[Path, ...]

    @classmethod
    def find(cls, data: Path, pattern: str, exclude: Sequence[str] = ()) -> "TextFiles":
        if data.is_file():
            return cls(data.parent, (data,), ())
        if not data.is_dir():
            raise ValueError(f"--data {str(data)!r} is neither a file nor a folder")
        skip = set(exclude)
        files = sorted(
            p
            for p in data.rglob(pattern)
            if p.is_file() and not skip & set(p.relative_to(data).parts[:-1])
        )
        if not files:
            raise ValueError(f"--data {str(data)!r} holds no file matching {pattern!r}")
        held = [p for p in files if is_held_out(p.relative_to(data))]
        return cls(data, tuple(p for p in files if p not in set(held)), tuple(held))


def read_texts(files: Sequence[Path]) -> list[str]:
    """Each file's UTF-8 text (files that are not UTF-8 are skipped)."""
    texts = []
    for path in files:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
    return texts


def token_windows(tokenizer, texts: Sequence[str], length: int, eos_id: int) -> torch.Tensor:
    """``[N, length]`` consecutive windows of the texts' tokens, each text ending in EOS (the
    way the demo model was trained)."""
    stream: list[int] = []
    for encoding in tokenizer(list(texts), add_special_tokens=True)["input_ids"]:
        stream += encoding + [eos_id]
    num = len(stream) // length
    if num == 0:
        raise ValueError(f"the data holds {len(stream)} tokens, fewer than one window ({length})")
    return torch.tensor(stream[: num * length], dtype=torch.long).view(num, length)


def shuffled_batches(windows: torch.Tensor, batch_size: int, seed: int):
    """Endless batches of windows, in a seeded order reshuffled each epoch."""
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        if len(order) < batch_size:
            fresh = list(range(len(windows)))
            rng.shuffle(fresh)
            order += fresh
        picked, order = order[:batch_size], order[batch_size:]
        yield windows[picked]
