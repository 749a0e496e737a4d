"""Issue 25's shape limits on the product code: no module over 500 lines, no function over 60.

Small modules and short functions are what keep this codebase easy to see into (style.md, 1); a
file that grows past the limit is split by concern, not trimmed of its docstrings."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("llmserve",)
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def product_modules() -> list[Path]:
    return sorted(p for d in PRODUCT for p in (ROOT / d).rglob("*.py") if "_pb2" not in p.name)


@pytest.mark.parametrize("path", product_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_and_function_sizes(path: Path) -> None:
    text = path.read_text()
    num_lines = text.count("\n")
    assert num_lines <= MAX_MODULE_LINES, (
        f"{path.relative_to(ROOT)} has {num_lines} lines (limit {MAX_MODULE_LINES}): split it by "
        "concern into modules whose names say their job"
    )
    long = [
        f"{node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{path.relative_to(ROOT)}: functions over {MAX_FUNCTION_LINES} lines: {long}"
