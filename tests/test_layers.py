"""Import layers (DESIGN.md): trainer_core never imports services; routes never reach the scheduler."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [("trainer_core", "services"), ("services/api/routes", "services.scheduler")],
)
def test_layer_boundaries(folder: str, forbidden: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(m for m in imported_modules(path) if m == forbidden or m.startswith(forbidden + "."))
        for path in (ROOT / folder).rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}
