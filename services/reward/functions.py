"""Built-in rule rewards, registered by name, and the weighted sum a run's spec asks for.

Pure functions of the response (text and token count) and the prompt's reference answer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Protocol

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class Term(Protocol):
    """The fields of a reward term that the functions read (``services.runspec.RewardTerm``)."""

    fn: str
    weight: float
    pattern: str | None
    target_tokens: int | None


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (commas as thousands separators allowed), else None."""
    found = _NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


def exact_match(term: Term, response: str, n_tokens: int, answer: str | None) -> float:
    """1.0 when the response's last number equals the answer's last number (the GSM8K convention)."""
    if answer is None:
        return 0.0
    want, got = last_number(answer), last_number(response)
    return float(want is not None and got is not None and abs(want - got) < 1e-9)


def regex_match(term: Term, response: str, n_tokens: int, answer: str | None) -> float:
    """1.0 when ``term.pattern`` matches somewhere in the response (anchor it for format checks)."""
    return float(re.search(term.pattern or "", response) is not None)


def length_penalty(term: Term, response: str, n_tokens: int, answer: str | None) -> float:
    """-(tokens beyond target) / target: 0 up to the target, -1 at twice the target."""
    target = term.target_tokens or 1
    return -max(0, n_tokens - target) / target


REWARD_FUNCTIONS: dict[str, Callable[[Term, str, int, str | None], float]] = {
    "exact_match": exact_match,
    "regex": regex_match,
    "length_penalty": length_penalty,
}


def total_reward(terms: Sequence[Term], response: str, n_tokens: int, answer: str | None) -> float:
    """The weighted sum of the spec's reward terms."""
    return sum(t.weight * REWARD_FUNCTIONS[t.fn](t, response, n_tokens, answer) for t in terms)
