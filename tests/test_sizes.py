"""The house's floor plan holds: no module of the package over 500 lines, no function over 60.

A module that outgrows it has taken a second job, and a function that long hides one; both
are split when they reach the limit, not later (issue 33).
"""

from __future__ import annotations

import ast
from pathlib import Path

import ckptfs

PACKAGE = Path(ckptfs.__file__).parent
MODULE_LINES = 500
FUNCTION_LINES = 60


def test_no_module_is_over_500_lines() -> None:
    long = {p.name: n for p in PACKAGE.glob("*.py")
            if (n := len(p.read_text().splitlines())) > MODULE_LINES}
    assert not long, f"split these modules: {long}"


def test_no_function_is_over_60_lines() -> None:
    long = []
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > FUNCTION_LINES:
                    long.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "split these functions:\n" + "\n".join(long)
