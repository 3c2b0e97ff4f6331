"""A user's own reward function, named by a reference and called as verl calls it.

A reference is ``path/to/file.py:name`` (loaded from the file, as verl's
``custom_reward_function.path`` and ``.name`` are) or ``package.module:name`` (imported from the
Python path); without ``:name`` the function is ``compute_score``. The function takes verl's
arguments for one response::

    def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

or, called once for a batch (verl's ``BatchRewardManager``), lists of them::

    def compute_score(data_sources, solution_strs, ground_truths, extra_infos) -> list[float | dict]

A dict result holds the reward under ``score``; its other finite numeric values become metrics.
Which form a function has is read from its parameter names, as verl's managers name them when
they call it; a function with other names is called positionally, for one response unless
``batched`` says otherwise.

The fingerprint names the code that scores: the sha256 of the file (for a module, of its source
file; for a package, of all its ``.py`` files) and the function's name. Workers execute exactly
the bytes that were fingerprinted, so an edited file never serves scores under its old
fingerprint. Nothing here repeats the file's contents or user code's exception text: errors
name the reference and say what to do.

Example::

    function = resolve("rewards/gsm8k.py:compute_score")
    fn = load(function)                       # runs the file: do this in a worker process
    style = call_style(fn, function)          # CallStyle(batched=False, by_keyword=True, ...)
    call(fn, style, [Item("#### 42", "42", "openai/gsm8k")])  # [Outcome(score=1.0, ...)]
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import importlib
import importlib.machinery
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SINGLE = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCHED = ("data_sources", "solution_strs", "ground_truths", "extra_infos")
DEFAULT_NAME = "compute_score"
MAX_METRICS = 32
MAX_METRIC_KEY = 64
_EXPECTED = f"({', '.join(SINGLE)}=None), or for a batch ({', '.join(BATCHED)})"


class UserFunctionError(ValueError):
    """The reference cannot be served; the message says what to do (never the file's contents)."""


class Failure(enum.StrEnum):
    """Why a response scored 0.0 instead of what the function would say."""

    EXCEPTION = "exception"  # the function raised (or its file did not import in a worker)
    TIMEOUT = "timeout"  # the call took longer than the time limit; its worker was replaced
    CRASH = "crash"  # the worker process died in the call (os._exit, a segfault); replaced
    MEMORY = "memory"  # the call ran out of the worker's memory limit
    INVALID = "invalid"  # the result is not a finite number, or a dict without a finite `score`


@dataclass(frozen=True)
class Item:
    """verl's arguments for one response."""

    solution_str: str
    ground_truth: Any = None
    data_source: str = ""
    extra_info: dict[str, Any] | None = None


@dataclass(frozen=True)
class Outcome:
    """One response's score; 0.0 with a failure when there is none to give."""

    score: float
    metrics: dict[str, float] | None = None
    failure: Failure | None = None

    @classmethod
    def failed(cls, failure: Failure) -> Outcome:
        return cls(0.0, None, failure)


@dataclass(frozen=True)
class UserFunction:
    """A resolved reference: where the code is and what it is, without having run any of it."""

    reference: str
    name: str
    fingerprint: str
    file: Path | None = None  # a file reference
    source: bytes | None = None  # that file's content, as fingerprinted: what workers execute
    module: str | None = None  # a module reference
    batched: bool | None = None  # the caller's word; None: read from the parameter names


@dataclass(frozen=True)
class CallStyle:
    batched: bool
    by_keyword: bool  # verl's parameter names; else positionally
    extra_info: bool  # the function takes extra_info(s)
    coroutine: bool = False


def resolve(reference: str, batched: bool | None = None) -> UserFunction:
    """The function ``reference`` names and its fingerprint; runs none of its code.

    >>> resolve("rewards.py:my_score").name   # doctest: +SKIP
    'my_score'
    """
    target, _, name = reference.rpartition(":") if ":" in reference else (reference, ":", DEFAULT_NAME)
    if not target or not name.isidentifier():
        raise UserFunctionError(
            f"`{reference}` is not a reward function reference: write path/to/file.py:name or package.module:name"
        )
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise UserFunctionError(f"reward function file `{target}` does not exist")
        source = path.read_bytes()
        return UserFunction(reference, name, _fingerprint(source, name), file=path, source=source, batched=batched)
    return UserFunction(reference, name, module_fingerprint(target, name), module=target, batched=batched)


def module_fingerprint(module: str, name: str) -> str:
    """The fingerprint of ``module``'s source (every ``.py`` file of a package, with its path
    in the package), found on the Python path without importing it."""
    files = _module_files(module)
    if len(files) == 1:
        return _fingerprint(files[0][1].read_bytes(), name)
    listing = b"".join(f"{rel}\0".encode() + hashlib.sha256(path.read_bytes()).digest() for rel, path in files)
    return _fingerprint(listing, name)


def _fingerprint(content: bytes, name: str) -> str:
    """``<sha256 of content>:<name>``: two functions of one file score differently."""
    return f"{hashlib.sha256(content).hexdigest()}:{name}"


def _module_files(module: str) -> list[tuple[str, Path]]:
    search: list[str] | None = None
    spec = None
    for part in module.split("."):
        if not part.isidentifier() or (spec is not None and search is None):
            raise UserFunctionError(f"cannot find module `{module}`: `{part}` is not a package's module")
        spec = importlib.machinery.PathFinder.find_spec(part, search)
        if spec is None:
            raise UserFunctionError(f"cannot find module `{module}` on the Python path: add its folder to PYTHONPATH")
        search = list(spec.submodule_search_locations) if spec.submodule_search_locations is not None else None
    if search is not None:  # a package: every source file under it
        return sorted(
            (str(p.relative_to(folder)), p) for folder in search for p in Path(folder).rglob("*.py") if p.is_file()
        )
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise UserFunctionError(f"module `{module}` is not Python source; name a .py module or package")
    return [(Path(spec.origin).name, Path(spec.origin))]


def load(function: UserFunction) -> Callable[..., Any]:
    """The function itself: runs the file, or imports the module (run this in a worker process)."""
    try:
        module = _import(function)
    except UserFunctionError:
        raise
    except MemoryError:
        raise UserFunctionError(
            f"`{function.reference}` ran out of memory while importing: raise the memory limit"
        ) from None
    except BaseException as e:  # noqa: BLE001 - user code: any failure is reported by type only
        raise UserFunctionError(
            f"`{function.reference}` does not import ({type(e).__name__}): run it with python to see why"
        ) from None
    fn = getattr(module, function.name, None)
    if fn is None:
        raise UserFunctionError(f"`{function.reference}`: the module defines no `{function.name}`")
    if not callable(fn):
        raise UserFunctionError(f"`{function.reference}`: `{function.name}` is not a function")
    return fn


def _import(function: UserFunction) -> Any:
    if function.module is not None:
        if module_fingerprint(function.module, function.name) != function.fingerprint:
            raise UserFunctionError(
                f"`{function.reference}` changed since it was fingerprinted: restart the reward server"
            )
        return importlib.import_module(function.module)
    assert function.file is not None and function.source is not None
    # As verl's load_module: a module of its own name, not importable by others; but executing
    # the fingerprinted bytes, not whatever the file holds now.
    spec = importlib.util.spec_from_file_location(f"spotrl_reward_{function.fingerprint[:16]}", function.file)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look their module up
    exec(compile(function.source, str(function.file), "exec"), module.__dict__)  # noqa: S102 - the user's own reward code
    return module


def call_style(fn: Callable[..., Any], function: UserFunction) -> CallStyle:
    """How to call ``fn``: by verl's names (batched if they are the batch's), else positionally."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        raise UserFunctionError(f"`{function.reference}`: cannot read the parameters of `{function.name}`") from None
    coroutine = inspect.iscoroutinefunction(fn)
    kinds = {p.kind for p in params.values()}
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    required = [
        n for n, p in params.items() if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    for batched, names in ((True, BATCHED), (False, SINGLE)):
        if set(names[:3]) <= named:
            if function.batched is not None and function.batched != batched:
                form = "a batch" if batched else "one response"
                raise UserFunctionError(
                    f"`{function.reference}` takes the arguments for {form}: {'add' if batched else 'drop'} --batched"
                )
            if set(required) - set(names):
                raise UserFunctionError(
                    f"`{function.reference}` needs arguments verl does not pass; it should take {_EXPECTED}"
                )
            extra = names[3] in named or inspect.Parameter.VAR_KEYWORD in kinds
            return CallStyle(batched, True, extra, coroutine)
    positional = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if (len(positional) >= 4 or inspect.Parameter.VAR_POSITIONAL in kinds) and set(required) <= set(positional[:4]):
        return CallStyle(bool(function.batched), False, True, coroutine)
    if not required and inspect.Parameter.VAR_KEYWORD in kinds:
        return CallStyle(bool(function.batched), True, True, coroutine)
    raise UserFunctionError(f"`{function.reference}` takes ({', '.join(params)}); it should take {_EXPECTED}")


def call(fn: Callable[..., Any], style: CallStyle, items: Sequence[Item]) -> list[Outcome]:
    """One call of ``fn`` per item (one for all of them when it is batched); what user code
    raises becomes a failure, never an exception here."""
    if style.batched:
        columns = (
            [i.data_source for i in items],
            [i.solution_str for i in items],
            [i.ground_truth for i in items],
            [_extra(i) for i in items],
        )
        result = _guarded(fn, style, BATCHED, columns)
        if isinstance(result, Failure):
            return [Outcome.failed(result)] * len(items)
        return _outcomes(result, len(items))
    outcomes = []
    for i in items:
        result = _guarded(fn, style, SINGLE, (i.data_source, i.solution_str, i.ground_truth, _extra(i)))
        outcomes.append(Outcome.failed(result) if isinstance(result, Failure) else outcome(result))
    return outcomes


def _extra(item: Item) -> dict[str, Any]:
    # As verl's NaiveRewardManager: always a dict, with the keys its managers add.
    extra = dict(item.extra_info or {})
    extra.setdefault("num_turns", None)
    extra.setdefault("rollout_reward_scores", {})
    return extra


def _guarded(fn: Callable[..., Any], style: CallStyle, names: tuple[str, ...], args: Sequence[Any]) -> Any:
    n = 4 if style.extra_info else 3
    try:
        result = fn(**dict(zip(names[:n], args, strict=False))) if style.by_keyword else fn(*args[:n])
        return asyncio.run(result) if style.coroutine else result
    except MemoryError:
        return Failure.MEMORY
    except BaseException:  # noqa: BLE001 - user code: its failure is the item's, never the worker's
        return Failure.EXCEPTION


def _outcomes(result: Any, n: int) -> list[Outcome]:
    if isinstance(result, (str, bytes, Mapping)) or not hasattr(result, "__len__"):
        return [Outcome.failed(Failure.INVALID)] * n
    try:
        values = list(result)
    except Exception:  # noqa: BLE001 - a user object that does not iterate
        return [Outcome.failed(Failure.INVALID)] * n
    if len(values) != n:
        return [Outcome.failed(Failure.INVALID)] * n
    return [outcome(v) for v in values]


def outcome(value: Any) -> Outcome:
    """A returned value as an outcome: a finite number, or a dict with a finite ``score``.

    >>> outcome({"score": 1, "acc": True, "pred": "42"})
    Outcome(score=1.0, metrics={'acc': 1.0}, failure=None)
    """
    metrics = None
    if isinstance(value, Mapping):
        if "score" not in value:
            return Outcome.failed(Failure.INVALID)
        metrics = {k: f for k, v in value.items() if _metric_key(k) and (f := _finite(v)) is not None}
        metrics = dict(list(metrics.items())[:MAX_METRICS]) or None
        value = value["score"]
    score = _finite(value)
    return Outcome.failed(Failure.INVALID) if score is None else Outcome(score, metrics)


def _metric_key(key: Any) -> bool:
    return isinstance(key, str) and key != "score" and 0 < len(key) <= MAX_METRIC_KEY


def _finite(value: Any) -> float | None:
    if value is None or isinstance(value, (str, bytes)):
        return None
    try:
        number = float(value)  # ints, bools, numpy scalars, 0-d tensors
    except Exception:  # noqa: BLE001 - a user object's __float__
        return None
    return number if math.isfinite(number) else None
