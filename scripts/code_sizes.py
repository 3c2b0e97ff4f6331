"""List the modules over 400 lines and the functions over 60 lines in services/, contracts/ and
trainer_core/: neither should be without a reason, and a long function gives its reason in its
docstring (shown here in part).

    .venv/bin/python scripts/code_sizes.py
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("services", "contracts", "trainer_core")
MODULE_LINES = 400
FUNCTION_LINES = 60


def oversized(path: Path) -> list[str]:
    """One line per oversized thing in the module at ``path``: the module itself, then its functions."""
    source = path.read_text()
    found = []
    if (lines := source.count("\n")) > MODULE_LINES:
        found.append(f"module   {path.relative_to(ROOT)}: {lines} lines")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            if length > FUNCTION_LINES:
                doc = " ".join((ast.get_docstring(node) or "no docstring").split())
                found.append(
                    f"function {path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines: {doc[:160]}"
                )
    return found


if __name__ == "__main__":
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for line in oversized(path):
                print(line)
