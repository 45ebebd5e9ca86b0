"""Benchmarks measure octavo as users run it: octavo is imported before torch loads OpenMP, so
its ``OMP_WAIT_POLICY=PASSIVE`` default applies. A script that imports torch first (directly, or
through safetensors or transformers) runs with spinning OpenMP threads instead, which moves
two-thread figures by 10% and more on a 2-core host."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent.parent / "benchmarks"
LOADS_OPENMP = {"torch", "safetensors", "transformers"}


def _roots(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name.split(".")[0] for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module.split(".")[0]]
    return []


def first_openmp_import_before_octavo(path: Path) -> int | None:
    """The line of the module-level import that loads torch before any octavo import, if any."""
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        roots = _roots(node)
        if "octavo" in roots:
            return None
        if LOADS_OPENMP.intersection(roots):
            return node.lineno
    return None


SCRIPTS = sorted(  # not the peers' virtual env and sources the compare run keeps beside them
    p
    for p in BENCHMARKS.rglob("*.py")
    if not any(part.startswith(".") for part in p.relative_to(BENCHMARKS).parts)
)


def test_the_benchmark_scripts_are_found():
    names = {p.name for p in SCRIPTS}
    assert {"spec_decode.py", "throughput.py", "run.py"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_octavo_is_imported_before_torch(script):
    line = first_openmp_import_before_octavo(script)
    assert line is None, (
        f"{script.name}:{line} imports torch (or a library that loads it) before octavo: import "
        "octavo first (see engine_thread_gemm.py) so the benchmark runs octavo's OpenMP settings"
    )


def test_the_check_sees_torch_through_another_library(tmp_path):
    script = tmp_path / "bench.py"
    script.write_text("import argparse\nfrom safetensors.torch import load_file\nimport octavo\n")
    assert first_openmp_import_before_octavo(script) == 2
    script.write_text("import octavo  # noqa: F401\nimport torch\n")
    assert first_openmp_import_before_octavo(script) is None
