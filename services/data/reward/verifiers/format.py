"""Format reward: 1.0 when a response follows a declared structure, else 0.0.

The default structure is the one of DeepSeek-R1-style reasoning recipes: the reasoning in
`<think>...</think>`, then the answer in `<answer>...</answer>`, with only whitespace around and
between them (open-r1's `format_reward`, `^<think>\\n.*?\\n</think>\\n<answer>\\n.*?\\n</answer>$`, with
its line breaks relaxed to any whitespace). Like verl's tag-count checks (`rlla.py`), each tag
appears once: no second `<answer>` inside the first, no `<think>` nested in the answer.

A custom structure is a regular expression that must match the whole response (as `re.fullmatch`),
matched by `safe_regex` with its time limit, so that a pattern that backtracks cannot hold the caller.
"""

from __future__ import annotations

import functools
import re

from services.core import safe_regex

# Any text without a think or answer tag in it.
_NO_TAG = r"(?:(?!</?(?:think|answer)>).)*"
_THINK_ANSWER = re.compile(rf"\s*<think>{_NO_TAG}</think>\s*<answer>{_NO_TAG}</answer>\s*", re.DOTALL)


def score(solution_str: str, pattern: str | None = None) -> float:
    """1.0 if `solution_str` is `<think>...</think>` then `<answer>...</answer>` (or, given `pattern`, matches
    it in full), else 0.0. Raises safe_regex.RewardTimeoutError if `pattern` does not decide within its limit.

    >>> score("<think>7 * 6 = 42</think>\\n<answer>42</answer>")
    1.0
    >>> score("<answer>42</answer>")
    0.0
    >>> score("Final answer: 42", r"(?s).*Final answer: \\d+")
    1.0
    """
    if pattern is None:
        return 1.0 if _THINK_ANSWER.fullmatch(solution_str) else 0.0
    return 1.0 if safe_regex.search(_anchored(pattern), solution_str) else 0.0


@functools.lru_cache(maxsize=64)
def _anchored(pattern: str) -> str:
    """`pattern` anchored at both ends of the text, so that a search is a full match. `\\Z` is the end of
    the text (unlike `$`, which also matches before a final newline); in verbose mode a `#` comment
    at the end of the pattern would swallow the closing parenthesis, so a line break ends it first."""
    try:
        verbose = bool(re.compile(pattern).flags & re.VERBOSE)
    except re.error:
        verbose = False  # safe_regex.search reports the pattern as one that does not compile
    return rf"\A(?:{pattern}{chr(10) if verbose else ''})\Z"
