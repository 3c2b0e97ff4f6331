"""Measure the house as a newcomer meets it: the folders of each package, the modules loose at
``services/``'s root, import cycles, imports that break the layers declared in pyproject.toml's
import contracts, and the largest modules.

    .venv/bin/python scripts/house.py
"""

from __future__ import annotations

import tomllib
from collections import Counter
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("services", "trainer_core", "contracts")
LARGEST = 8


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan's
    algorithm, iterative): each is a set of modules that import each other, directly or not."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _layer_of(module: str, layers: list[list[str]]) -> int | None:
    for rank, names in enumerate(layers):
        if any(module == name or module.startswith(name + ".") for name in names):
            return rank
    return None


def upward_imports(graph: grimp.ImportGraph) -> list[str]:
    """Each import that runs from a lower layer to a higher one, or between independent siblings,
    in the ``layers`` contracts of pyproject.toml (listed top first)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found = []
    for contract in config["tool"]["importlinter"]["contracts"]:
        if contract["type"] != "layers":
            continue
        containers = contract.get("containers", [""])
        for container in containers:
            prefix = f"{container}." if container else ""
            layers = [[prefix + name.strip() for name in line.split("|")] for line in contract["layers"]]
            for importer in sorted(graph.modules):
                low = _layer_of(importer, layers)
                if low is None:
                    continue
                for imported in sorted(graph.find_modules_directly_imported_by(importer)):
                    high = _layer_of(imported, layers)
                    same_sibling = high == low and any(
                        importer.startswith(n) != imported.startswith(n) for n in layers[low] if len(layers[low]) > 1
                    )
                    if high is not None and (high < low or same_sibling):
                        found.append(f"{importer} -> {imported}")
    return found


def main() -> None:
    graph = grimp.build_graph(*PACKAGES)
    services = ROOT / "services"
    loose = sorted(p.name for p in services.glob("*.py"))
    folders = sorted(
        p.relative_to(ROOT).as_posix() for p in services.rglob("*") if p.is_dir() and (p / "__init__.py").exists()
    )
    print(f"folders under services/: {len(folders)}")
    for folder in folders:
        print(f"  {folder}/ ({len(list((ROOT / folder).glob('*.py')))} modules)")
    print(f"modules loose at services/ root: {len(loose)}: {' '.join(loose)}")
    found = cycles(graph)
    print(f"import cycles: {len(found)}")
    for component in found:
        print("  " + " <-> ".join(component))
    upward = upward_imports(graph)
    print(f"imports against the layers: {len(upward)}")
    for line in upward:
        print("  " + line)
    sizes = Counter()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            sizes[path.relative_to(ROOT).as_posix()] = path.read_text().count("\n")
    print(f"largest modules (of {len(sizes)}):")
    for path, lines in sizes.most_common(LARGEST):
        print(f"  {lines:5d} {path}")


if __name__ == "__main__":
    main()
