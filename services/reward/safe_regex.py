"""Regular expressions of reward terms, matched with a time limit.

A run's spec may score responses with a pattern of its own (the `regex` reward), and some
patterns backtrack catastrophically: `([\\s\\S]+)+\\x00` under Python's `re` never finishes on a
long enough response, and it would hold a rollout worker forever. Patterns are therefore
matched with the `regex` package (PyPI; a dependency of transformers already), whose default
(V0) syntax and semantics are `re`'s, and whose `search` takes a `timeout`.

RE2 (`google-re2`) would rule backtracking out altogether, but it changes what ordinary
patterns mean: `$` does not match before a final newline (`</answer>$` fails on a response
ending in "\\n"), `\\d`, `\\w` and `\\s` are ASCII only, and lookarounds and backreferences are
refused. A time limit keeps every pattern meaning what `re` documents. (One known difference of
`regex`: a negated set of a class and its complement, `[^\\s\\S]`, matches any character.)

Torch-free: the API checks a submitted run spec's pattern with `check_pattern`.
"""

from __future__ import annotations

import functools
import re
import re._constants as sre_constants
import re._parser as sre_parse

import regex

# Long enough for any format check; a pattern longer than this is more likely a mistake or abuse.
MAX_PATTERN_CHARS = 1000
# Per match. An ordinary pattern decides a response of a few thousand characters in well under
# a millisecond; one that takes this long is backtracking, and a batch of such responses would
# stall its worker for (responses x this).
DEFAULT_TIMEOUT_S = 0.5
# Items of a pattern with its counted repeats unrolled, as `regex` does when it compiles:
# `a{999999999}` took tens of GB before any time limit applied (one such spec got the API server
# killed for memory). 10,000 compile in milliseconds; format checks need a few hundred at most.
MAX_REPEAT_COUNT = 10_000


class RewardError(Exception):
    """A reward could not be computed for a response (its term then scores 0.0 for it); `kind`
    says why in one word, by which the run counts its failures: exception, timeout, crash,
    memory, invalid (a score that is no finite number, or input the reward cannot read) or
    unavailable (a reward service that does not answer)."""

    def __init__(self, message: str, kind: str = "exception") -> None:
        super().__init__(message)
        self.kind = kind


class RewardTimeoutError(RewardError):
    """A reward pattern did not decide a response within its time limit."""

    def __init__(self, message: str) -> None:
        super().__init__(message, kind="timeout")


def check_pattern(pattern: str) -> None:
    """Raise ValueError, saying why, unless `pattern` is a regular expression a reward term may use:
    at most MAX_PATTERN_CHARS long, valid in Python's `re` syntax (the one the run spec documents)
    and compiled by the engine that matches it."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"`pattern` is {len(pattern)} characters long; at most {MAX_PATTERN_CHARS} are accepted")
    try:
        parsed = sre_parse.parse(pattern)
    except re.error as e:
        raise ValueError(f"`pattern` is not a valid regular expression: {e}") from e
    if (count := _repeat_count(parsed)) > MAX_REPEAT_COUNT:
        raise ValueError(
            f"`pattern` unrolls to {count} items (its counted repeats `{{n}}` multiplied out); at most {MAX_REPEAT_COUNT} are accepted"
        )
    try:
        _compiled(pattern)
    except regex.error as e:
        raise ValueError(f"`pattern` is valid for Python's re but not for the reward's regex engine: {e}") from e


def _repeat_count(pattern: sre_parse.SubPattern) -> int:
    """How many items a pattern parsed by `re` unrolls to: its items summed, a repeat counting
    its body times its upper bound (its lower one when unbounded: `*`, `+`, `{n,}`), at least 1."""
    total = 0
    for op, av in pattern.data:
        if op in _REPEATS:
            low, high, body = av
            total += max(low if high == sre_constants.MAXREPEAT else high, 1) * _repeat_count(body)
        else:
            total += max(sum(_repeat_count(child) for child in _subpatterns(av)), 1)
    return total


def _subpatterns(av: object) -> list[sre_parse.SubPattern]:
    """The parsed sub-patterns inside an operation's argument (a group, a branch, a lookaround)."""
    if isinstance(av, sre_parse.SubPattern):
        return [av]
    if isinstance(av, list | tuple):
        return [sub for item in av for sub in _subpatterns(item)]
    return []


_REPEATS = (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT, sre_constants.POSSESSIVE_REPEAT)


@functools.lru_cache(maxsize=64)
def _compiled(pattern: str) -> regex.Pattern[str]:
    return regex.compile(pattern)


def search(pattern: str, text: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether `pattern` matches somewhere in `text` (as `re.search` would); raise
    RewardTimeoutError if that is not decided within `timeout_s` seconds, and RewardError if the
    pattern does not compile (a spec stored before `check_pattern` existed)."""
    try:
        compiled = _compiled(pattern)
    except regex.error as e:
        raise RewardError(f"pattern {_shown(pattern)} does not compile: {e}") from e
    try:
        # concurrent: the match runs without the GIL, so the worker's other threads (the queue
        # client's heartbeats) keep running while a slow pattern uses up its time.
        return compiled.search(text, timeout=timeout_s, concurrent=True) is not None
    except TimeoutError as e:
        raise RewardTimeoutError(f"pattern {_shown(pattern)} did not decide a response within {timeout_s:g} s") from e


def _shown(pattern: str, limit: int = 80) -> str:
    """The pattern for a message: quoted, and cut to `limit` characters."""
    return repr(pattern if len(pattern) <= limit else pattern[:limit] + "...")
