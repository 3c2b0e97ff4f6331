"""Code reward: the fraction of an item's test cases that the program in a response passes.

The program is the last ```python block of the response (else its last untagged block, else the
whole response); each test case runs it once in the sandbox (`sandbox.run`), so that a case that
hangs or crashes fails alone.

Test cases come in the layouts that verl's code datasets carry in `reward_model.ground_truth`
(verl `utils/reward_score/prime_code` and `sandbox_fusion`), as a dict or its JSON string:
- `{"inputs": [...], "outputs": [...]}`: standard input and expected standard output, compared
  token by token (whitespace and line breaks aside; numbers within 1e-6); an output of None
  asks only that the program exit with 0;
- the same with `"fn_name"`: call-based (LeetCode style). Each input holds the arguments, as one
  JSON value per line (PRIME) or as a list (APPS); the function is global or a method of
  `Solution`; its result must equal the output (or the output's only element: APPS wraps them);
- `{"assert_case": [...]}` (sandbox_fusion) or a plain list of strings: `assert` statements, each
  appended to the program; a string that is not JSON is one such block.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from services.core.safe_regex import RewardError
from services.data.reward.verifiers.sandbox import DEFAULT_LIMITS, SandboxLimits, SandboxResult, run

# A fenced block, its tag (python, py, another language or none) and its code, up to the closing
# fence or the end of a truncated response.
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)

# Appended to the program for a call-based case: calls the function on the arguments and prints its
# result as JSON on a line of its own, after a marker the program is not told.
_CALL = """

def _spotrl_call():
    import json, sys
    target = globals().get({fn_name!r})
    if target is None and "Solution" in globals():
        target = getattr(Solution(), {fn_name!r})
    result = target(*json.loads({args!r}))
    sys.stdout.write("\\n" + {marker!r} + json.dumps(result, default=repr) + "\\n")

_spotrl_call()
"""


@dataclass(frozen=True)
class _Case:
    """One test: the program to run, its input, and whether a run passed."""

    program: str
    stdin: str
    passed: Callable[[SandboxResult], bool]


def score(
    solution_str: str, tests: str | Mapping[str, Any] | list[str], *, limits: SandboxLimits = DEFAULT_LIMITS
) -> float:
    """The fraction of `tests` (any layout of the module's docstring) that the response's program passes.
    Raises RewardError if `tests` holds no test case, or the sandbox itself failed.

    >>> score("```python\\nprint(int(input()) + 1)\\n```", {"inputs": ["1", "5"], "outputs": ["2", "7"]})
    0.5
    """
    cases = _cases(extract_program(solution_str), tests)
    return sum(case.passed(run(case.program, case.stdin, limits)) for case in cases) / len(cases)


def extract_program(solution_str: str) -> str:
    """The last ```python fenced block of a response, else its last untagged one, else the whole response.

    >>> extract_program("First:\\n```python\\nx = 1\\n```\\nBetter:\\n```python\\nx = 2\\n```\\nRun:\\n```bash\\npython x.py\\n```")
    'x = 2\\n'
    """
    blocks = _FENCE.findall(solution_str)
    python = [code for tag, code in blocks if tag.lower() in ("python", "python3", "py")]
    untagged = [code for tag, code in blocks if not tag]
    return (python or untagged or [solution_str])[-1]


def _cases(program: str, tests: Any) -> list[_Case]:
    tests = _plain(tests)
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError:
            tests = [tests]  # a block of assert statements
    if isinstance(tests, Mapping) and isinstance(tests.get("assert_case"), list):
        tests = tests["assert_case"]
    if isinstance(tests, list) and all(isinstance(t, str) for t in tests):
        cases = [_assert_case(program, t) for t in tests]
    elif (
        isinstance(tests, Mapping) and isinstance(tests.get("inputs"), list) and isinstance(tests.get("outputs"), list)
    ):
        if len(tests["inputs"]) != len(tests["outputs"]):
            raise RewardError(f"test cases have {len(tests['inputs'])} inputs but {len(tests['outputs'])} outputs")
        make = _call_case if tests.get("fn_name") else _stdio_case
        cases = [
            make(program, i, o, tests.get("fn_name")) for i, o in zip(tests["inputs"], tests["outputs"], strict=True)
        ]
    else:
        raise RewardError(f"test cases in no known layout: {str(tests)[:200]!r}")
    if not cases:
        raise RewardError("the item has no test cases")
    return cases


def _plain(value: Any) -> Any:
    """`value` with numpy arrays (what a parquet dataset's lists load as) turned into lists, recursively."""
    if hasattr(value, "tolist") and not isinstance(value, str | bytes):
        value = value.tolist()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _stdio_case(program: str, stdin: Any, expected: Any, _fn_name: None) -> _Case:
    stdin = "\n".join(map(str, stdin)) if isinstance(stdin, list) else "" if stdin is None else str(stdin)
    if expected is None:
        return _Case(program, stdin, lambda r: r.ok)
    expected = "\n".join(map(str, expected)) if isinstance(expected, list) else str(expected)
    return _Case(program, stdin, lambda r: r.ok and _same_tokens(r.stdout, expected))


def _call_case(program: str, args: Any, expected: Any, fn_name: str) -> _Case:
    if isinstance(args, str):
        try:
            args = [json.loads(line) for line in args.split("\n") if line.strip()]
        except json.JSONDecodeError as e:
            raise RewardError(f"call-based test input is not one JSON value per line: {args[:200]!r}") from e
    if isinstance(expected, str):
        with contextlib.suppress(json.JSONDecodeError):  # else a plain string result
            expected = json.loads(expected)
    marker = secrets.token_hex(16)

    def passed(r: SandboxResult) -> bool:
        lines = [line for line in r.stdout.splitlines() if line.startswith(marker)]
        if not r.ok or not lines:
            return False
        got = json.loads(lines[-1][len(marker) :])
        return _same_value(got, expected) or (
            isinstance(expected, list) and len(expected) == 1 and _same_value(got, expected[0])
        )

    return _Case(program + _CALL.format(fn_name=fn_name, args=json.dumps(args), marker=marker), "", passed)


def _assert_case(program: str, assertions: str) -> _Case:
    # Passing means printing, after the asserts, a marker the program is not told: a program that
    # exits early (`sys.exit(0)`) skips the asserts and the marker.
    marker = secrets.token_hex(16)
    return _Case(
        f"{program}\n\n{assertions}\n\nprint({marker!r})\n", "", lambda r: r.ok and r.stdout.rstrip().endswith(marker)
    )


def _same_tokens(got: str, expected: str) -> bool:
    """Whether two outputs have the same whitespace-separated tokens, numbers equal within 1e-6."""
    a, b = got.split(), expected.split()
    return len(a) == len(b) and all(x == y or _close(x, y) for x, y in zip(a, b, strict=True))


def _close(x: str, y: str) -> bool:
    try:
        fx, fy = float(x), float(y)
    except ValueError:
        return False
    return math.isclose(fx, fy, rel_tol=1e-6, abs_tol=1e-6)


def _same_value(got: Any, expected: Any) -> bool:
    """Equality of JSON values (tuples arrive as lists), floats within 1e-6."""
    if isinstance(got, float) or isinstance(expected, float):
        return (
            isinstance(got, int | float)
            and isinstance(expected, int | float)
            and math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-6)
        )
    if isinstance(got, list) and isinstance(expected, list):
        return len(got) == len(expected) and all(_same_value(g, e) for g, e in zip(got, expected, strict=True))
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(_same_value(got[k], expected[k]) for k in got)
    return got == expected and type(got) is type(expected)
