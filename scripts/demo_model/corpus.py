"""The training text: the pure-Python standard library of the running interpreter.

File lists are sorted and the held-out split is a hash of each file's path relative to the
standard library, so the same interpreter always yields the same split and the same order.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import List, Tuple

from octavo.train_draft.data import is_held_out, read_texts

# Directory names whose contents are not library source: test suites, installed packages,
# codec tables (encodings/), the pydoc topic dump, the build configuration.
EXCLUDED_DIRS = frozenset(
    {"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data", "__pycache__"}
)
# One file in twenty, chosen by a hash of its path, is held out: the rule octavo train-draft
# applies too, so the demo model's draft heads never train on its held-out files.


@dataclass(frozen=True)
class Corpus:
    """The stdlib files split into training and held-out sets, each sorted by relative path."""

    root: Path
    train_files: Tuple[Path, ...]
    held_out_files: Tuple[Path, ...]

    def read(self, files: Tuple[Path, ...]) -> List[str]:
        """The text of each file, decoded as UTF-8 (files that are not UTF-8 are skipped)."""
        return read_texts(files)


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_library_source(relative: Path) -> bool:
    if any(part in EXCLUDED_DIRS or part.startswith("config-") for part in relative.parts[:-1]):
        return False
    return not relative.name.startswith("_sysconfigdata")


def load_corpus(root: Path) -> Corpus:
    """Every library ``*.py`` file under ``root``, split into training and held-out files."""
    if not root.is_dir():
        raise ValueError(f"standard library directory {root} does not exist; pass --stdlib PATH")
    relatives = sorted(
        (p.relative_to(root) for p in root.rglob("*.py")), key=lambda rel: rel.as_posix()
    )
    relatives = [rel for rel in relatives if _is_library_source(rel)]
    if not relatives:
        raise ValueError(f"no Python source files found under {root}")
    train = tuple(root / rel for rel in relatives if not is_held_out(rel))
    held_out = tuple(root / rel for rel in relatives if is_held_out(rel))
    return Corpus(root=root, train_files=train, held_out_files=held_out)
