"""verl 0.9.1's real `verl.trainer.ppo.core_algos`, imported for the differential tests of
`trainer_core.algos` (tests/trainer_core/algos/test_verl_parity.py).

verl is installed with `--no-deps` into a folder of its own, `.venv/verl` (Makefile), not into
site-packages: its declared dependencies (ray, vllm, hydra, tensordict, ...) are a training
cluster's worth of packages spotrl does not use, and its wheel also ships a top-level `tests`
package that would shadow spotrl's. That folder is on `sys.path` only while importing. Importing
`core_algos` still runs the module-level imports of verl's package tree, so the roots of those
packages that are not installed are served, for the duration of the import only, by empty stub
modules whose every attribute is a do-nothing class.

Why the stubs are safe: the functions compared (policy losses, `agg_loss`, `kl_penalty`, the
advantage estimators) are pure torch (and numpy/defaultdict for grouping); they never call into
ray, hydra, tensordict or the other stubbed packages, which only the module headers of verl's
unrelated subsystems (workers, data protocol, config loading, tracking) name. A stub reached at
call time would return None or an empty object and the comparison with our numbers would fail,
not pass silently.

Nothing leaks: the folder and the finder leave `sys.path` and `sys.meta_path` after the import,
and the stub modules and verl's own modules are dropped from `sys.modules`, so `import ray` or
`import verl` anywhere else in the test process fails as it does without this module (the
returned module keeps its references).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

VERL_VERSION = "0.9.1"
VERL_DIR = Path(sys.prefix) / "verl"  # `pip install --no-deps --target .venv/verl verl==0.9.1`

# Top-level packages verl's import chain names and spotrl's venv does not hold.
_STUB_ROOTS = frozenset(
    {
        "orjson",
        "ray",
        "tensordict",
        "codetiming",
        "hydra",
        "omegaconf",
        "wandb",
        "datasets",
        "torchdata",
        "pyarrow",
        "pybind11",
        "dill",
        "liger_kernel",
        "flash_attn",
        "pylatexenc",
    }
)


def _stub_attribute(name: str) -> type:
    if name.startswith("__"):
        raise AttributeError(name)
    return type(
        name,
        (),
        {
            "__init__": lambda *a, **k: None,
            "__call__": lambda *a, **k: None,
            "__class_getitem__": classmethod(lambda cls, item: cls),
        },
    )


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves an empty package for every module under `roots`."""

    def __init__(self, roots: frozenset[str]) -> None:
        self.roots = roots

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _stub_attribute
        return module

    def exec_module(self, module) -> None:
        pass


@functools.cache
def core_algos() -> types.ModuleType:
    """verl's `core_algos` module; raises with what to do if verl 0.9.1 is not installed."""
    from importlib.metadata import distributions

    installed = [d.version for d in distributions(name="verl", path=[str(VERL_DIR)])]
    if installed != [VERL_VERSION]:
        raise RuntimeError(
            f"the verl parity tests need verl=={VERL_VERSION} in {VERL_DIR} (found {installed or 'none'}): run "
            f"`make setup`, or `.venv/bin/pip install --no-deps --target .venv/verl verl=={VERL_VERSION}`"
        )
    finder = _StubFinder(frozenset(r for r in _STUB_ROOTS if importlib.util.find_spec(r) is None))
    before = set(sys.modules)
    sys.path.append(str(VERL_DIR))  # last: its `tests` package must not shadow spotrl's
    sys.meta_path.insert(0, finder)
    try:
        module = importlib.import_module("verl.trainer.ppo.core_algos")
    finally:
        sys.meta_path.remove(finder)
        sys.path.remove(str(VERL_DIR))
        for name in set(sys.modules) - before:
            if name.split(".")[0] in finder.roots | {"verl"}:
                del sys.modules[name]
    return module
