"""The core stays readable: no module under core/octavo over 500 lines, no function or method
over 70 lines (the scheduler's ``schedule`` may reach 150). A function's length runs from its
``def`` line to its last line, docstring included, decorators not."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "core" / "octavo"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 70
MAX_FUNCTION_LINES_BY_NAME = {"schedule": 150}

MODULES = sorted(CORE.rglob("*.py"))


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line}"


def long_functions(path: Path) -> list[str]:
    """``path:line name (N lines > limit)`` for each function or method over its limit."""
    tree = ast.parse(path.read_text(), filename=str(path))
    offenders = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        limit = MAX_FUNCTION_LINES_BY_NAME.get(node.name, MAX_FUNCTION_LINES)
        num_lines = node.end_lineno - node.lineno + 1
        if num_lines > limit:
            offenders.append(
                f"{_where(path, node.lineno)} {node.name} ({num_lines} lines > {limit})"
            )
    return offenders


def test_the_core_has_modules_to_check():
    assert len(MODULES) > 50, f"found only {len(MODULES)} modules under {CORE}"


def test_no_core_module_is_over_500_lines():
    offenders = []
    for path in MODULES:
        num_lines = len(path.read_text().splitlines())
        if num_lines > MAX_MODULE_LINES:
            offenders.append(f"{_where(path, 1)} ({num_lines} lines > {MAX_MODULE_LINES})")
    assert not offenders, "modules to split:\n" + "\n".join(offenders)


def test_no_core_function_is_over_70_lines():
    offenders = [offender for path in MODULES for offender in long_functions(path)]
    assert not offenders, "functions to split:\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    ("name", "num_lines", "too_long"),
    [("step", 70, False), ("step", 71, True), ("schedule", 150, False), ("schedule", 151, True)],
)
def test_long_functions_applies_the_limits(tmp_path, name, num_lines, too_long):
    """The checker itself: a method exactly at its limit passes, one line more is reported."""
    body = "".join(f"        x{i} = {i}\n" for i in range(num_lines - 1))
    path = tmp_path / "module.py"
    path.write_text(f"class C:\n    def {name}(self):\n{body}")
    offenders = long_functions(path)
    assert offenders == (
        [f"{path}:2 {name} ({num_lines} lines > {num_lines - 1})"] if too_long else []
    )
