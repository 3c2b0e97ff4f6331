"""Reward patterns: checked on submission, matched as `re.search` would, never for longer than a time limit."""

from __future__ import annotations

import re

import pytest

from services.core.safe_regex import (
    MAX_PATTERN_CHARS,
    MAX_REPEAT_COUNT,
    RewardError,
    RewardTimeoutError,
    check_pattern,
    search,
)

# Patterns that backtrack exponentially in the engine too: no answer within any short limit.
BACKTRACKING = [(r"(\w+\s?)+$", "word" * 500 + "!"), (r"^(a|aa)+$", "a" * 2000 + "b"), (r"^(.|\s|\S)*(?!)", "x" * 60)]


@pytest.mark.parametrize(
    "pattern",
    [
        r"^\d+$",
        r"(?s)<think>.*?</think>\s*<answer>.*?</answer>\s*$",
        r"\\boxed\{[^}]*\}",
        r"(?<=answer: )\w+",
        r"(\w)\1",
        r"^\d{1,3}(,\d{3})*$",
        "(?:a{100}){100}",
    ],
)
def test_ordinary_patterns_are_accepted(pattern: str) -> None:
    check_pattern(pattern)


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("(", "not a valid regular expression"),
        (r"\p{L}+", "not a valid regular expression"),  # the regex package's syntax, not Python's
        ("a" * (MAX_PATTERN_CHARS + 1), f"at most {MAX_PATTERN_CHARS}"),
        # Compiled, each took the engine tens of GB (it unrolls counted repeats) and got the API killed.
        ("a{999999999}", "unrolls to 999999999 items"),
        ("((a{1000}){1000}){1000}", f"at most {MAX_REPEAT_COUNT}"),
        ("a{9999}" * 140, f"at most {MAX_REPEAT_COUNT}"),
        ("(?:x|y{20000})", f"at most {MAX_REPEAT_COUNT}"),
    ],
    ids=[
        "unbalanced",
        "not re syntax",
        "too long",
        "huge repeat",
        "nested repeats",
        "many repeats",
        "repeat in a branch",
    ],
)
def test_check_pattern_says_why_a_pattern_is_refused(pattern: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        check_pattern(pattern)


@pytest.mark.parametrize(
    ("pattern", "text"),
    [
        (r"</answer>$", "<answer>4</answer>\n"),  # `$` before a final newline (RE2 would say no)
        (r"^\d+$", "١٢٣"),  # Unicode digits
        (r"^\w+$", "café"),
        (r"(?<=a)b", "ab"),
        (r"(a)\1", "aa"),
        (r"(?i)ANSWER", "the answer"),
        (r"^a.b$", "a\nb"),
        (r"(?s)^a.b$", "a\nb"),
        (r"\bfoo\b", "éfoo"),
        (r"^\d+$", "12 apples"),
    ],
)
def test_search_decides_as_re_search_does(pattern: str, text: str) -> None:
    assert search(pattern, text, timeout_s=5.0) == (re.search(pattern, text) is not None)


@pytest.mark.parametrize(("pattern", "text"), BACKTRACKING)
def test_a_backtracking_pattern_raises_a_timeout(pattern: str, text: str) -> None:
    with pytest.raises(RewardTimeoutError, match="did not decide a response within 0.05 s") as info:
        search(pattern, text, timeout_s=0.05)
    assert isinstance(info.value, RewardError)


def test_the_pattern_of_the_report_returns_on_a_long_response() -> None:
    """Regression: `([\\s\\S]+)+\\x00` held a rollout worker forever under `re` on a long response.
    The engine decides it (no NUL in the text, so no match) instead of backtracking."""
    assert search(r"([\s\S]+)+\x00", "The answer is 42. " * 111, timeout_s=1.0) is False


def test_a_pattern_that_does_not_compile_is_a_reward_error() -> None:
    with pytest.raises(RewardError, match="does not compile"):
        search("(", "text")
