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
        re.compile(pattern)  # `re` keeps counted repeats as loops: no memory spent on `a{999999999}`
    except re.error as e:
        raise ValueError(f"`pattern` is not a valid regular expression: {e}") from e
    if (count := _repeat_count(pattern)) > MAX_REPEAT_COUNT:
        raise ValueError(
            f"`pattern` unrolls to {count} items (its counted repeats `{{n}}` multiplied out); at most {MAX_REPEAT_COUNT} are accepted"
        )
    try:
        _compiled(pattern)
    except regex.error as e:
        raise ValueError(f"`pattern` is valid for Python's re but not for the reward's regex engine: {e}") from e


def _repeat_count(pattern: str) -> int:
    """How many items `pattern` (valid for `re`) unrolls to: its items summed, a repeat counting
    its body times its upper bound (its lower one when unbounded: `*`, `+`, `{n,}`), at least 1.

    Counted by a scan of the pattern's text, as `re`'s parser reads it, because the standard
    library publishes no parse tree; where `re` would merge items (`a|b` read as `[ab]`) the scan
    counts each, so it never counts fewer than `re`'s parse tree would."""
    return _RepeatScan(pattern).count()


class _RepeatScan:
    """One left-to-right read of a pattern `re` has already accepted, so it needs no error paths."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.pos = 0

    def count(self) -> int:
        return self._sequence(verbose=False)

    def _sequence(self, verbose: bool) -> int:
        """The items up to the closing `)` (or the end), its branches summed; the `)` is left."""
        text = self.pattern
        branches: list[int] = []
        items: list[int] = []
        while self.pos < len(text) and text[self.pos] != ")":
            char = text[self.pos]
            if verbose and char.isspace():
                self.pos += 1
            elif verbose and char == "#":
                self.pos = _past(text, self.pos, "\n")
            elif char == "|":
                branches.append(sum(items))
                items = []
                self.pos += 1
            elif (bounds := self._quantifier()) is not None:
                # `re` refuses a quantifier with nothing before it, so an item is there to repeat.
                items.append(max(bounds, 1) * items.pop())
            else:
                item, verbose = self._item(verbose)
                if item:
                    items.append(item)
        return max(sum(branches) + sum(items), 1) if branches else sum(items)

    def _quantifier(self) -> int | None:
        """The repeat bound of a quantifier at the cursor (its upper one, or its lower when
        unbounded), moving past it and a lazy `?` or possessive `+`; None if there is none."""
        text = self.pattern
        if text[self.pos] in "*+?":
            bound = 1  # `?` at most once; `*` and `+` are unbounded, so counted at their lower bound
            self.pos += 1
        elif (found := _BRACES.match(text, self.pos)) and found.group() != "{}":
            low, comma, high = found.groups()
            bound = int(high) if high else int(low or 0) if comma else int(low)
            self.pos = found.end()
        else:
            return None
        if self.pos < len(text) and text[self.pos] in "?+":
            self.pos += 1
        return bound

    def _item(self, verbose: bool) -> tuple[int, bool]:
        """The count of the item at the cursor (0 for one that matches nothing: a comment, a
        flag setting), moving past it, and whether verbose mode holds after it."""
        text = self.pattern
        char = text[self.pos]
        if char == "\\":
            self.pos = _escape_end(text, self.pos)
        elif char == "[":
            self.pos = _set_end(text, self.pos)
        elif char == "(":
            return self._group(verbose)
        else:
            self.pos += 1
        return 1, verbose

    def _group(self, verbose: bool) -> tuple[int, bool]:
        """As `_item`, for the `(` at the cursor: a group counts what it holds, at least 1."""
        text = self.pattern
        self.pos += 1
        inner_verbose = verbose
        if text.startswith("?", self.pos):
            self.pos += 1
            kind = text[self.pos]
            if kind == "#" or text.startswith("P=", self.pos):  # a comment, a named backreference
                self.pos = _past(text, self.pos, ")")
                return (0 if kind == "#" else 1), verbose
            if kind == "(":  # a condition `(?(group)yes|no)`: both branches counted
                self.pos = text.index(")", self.pos) + 1
            elif text.startswith("P<", self.pos):
                self.pos = text.index(">", self.pos) + 1
            elif text.startswith(("<=", "<!"), self.pos):
                self.pos += 2
            elif kind in ":=!>":
                self.pos += 1
            else:  # flags: `(?x)` for the rest of the pattern, `(?x-i:...)` for the group alone
                flags = _FLAGS.match(text, self.pos)
                self.pos = flags.end()
                on, off = flags.group(1), flags.group(2) or ""
                switched = (verbose or "x" in on) and "x" not in off
                if flags.group(3) == ")":
                    return 0, switched
                inner_verbose = switched
        inner = self._sequence(inner_verbose)
        self.pos += 1  # the closing `)`
        return max(inner, 1), verbose


def _past(text: str, pos: int, stop: str) -> int:
    """Where the first `stop` from `pos` on ends (or the pattern's end), a backslash escaping the
    character after it: `re` reads `(?#a\\)b)` as one comment."""
    while pos < len(text):
        if text[pos] == stop:
            return pos + 1
        pos += 2 if text[pos] == "\\" else 1
    return len(text)


def _escape_end(text: str, pos: int) -> int:
    """Where the escape starting at `pos` (a backslash) ends, as `re` reads escapes."""
    char = text[pos + 1]
    if char in _HEX_DIGITS:
        return pos + 2 + _HEX_DIGITS[char]
    if char == "N" and text.startswith("{", pos + 2):
        return text.index("}", pos) + 1
    if char == "0":  # a character in octal: up to two more digits
        end = pos + 2
        while end < min(pos + 4, len(text)) and text[end] in _OCTAL:
            end += 1
        return end
    if char in _DIGITS:  # a group's number, one or two digits, unless three octal digits make a character
        end = pos + 2
        if end < len(text) and text[end] in _DIGITS:
            end += 1
            if text[pos + 1] in _OCTAL and text[pos + 2] in _OCTAL and end < len(text) and text[end] in _OCTAL:
                end += 1
        return end
    return pos + 2


def _set_end(text: str, pos: int) -> int:
    """Where the set `[...]` starting at `pos` ends: a `]` first (after an optional `^`) is a member."""
    pos += 1
    if text.startswith("^", pos):
        pos += 1
    if text.startswith("]", pos):
        pos += 1
    while text[pos] != "]":
        pos += 2 if text[pos] == "\\" else 1
    return pos + 1


_BRACES = re.compile(r"\{(\d*)(,?)(\d*)\}")
_FLAGS = re.compile(r"([aiLmsux]*)(?:-([imsx]*))?([:)])")
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}
_DIGITS = "0123456789"
_OCTAL = "01234567"


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
