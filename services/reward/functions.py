"""Built-in rewards, registered by name, and the weighted sum a run's spec asks for.

Rule rewards are pure functions of the response (text and token count) and the prompt's
reference answer. The `reward_model` reward scores (prompt, response) with a trained reward
model (`trainer_core.supervised.reward_model`), loaded once per process and run over a batch at a time;
every registered function therefore scores a batch.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from trainer_core.supervised.reward_model import RewardModel

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class Term(Protocol):
    """The fields of a reward term that the functions read (``services.runspec.RewardTerm``)."""

    fn: str
    weight: float
    pattern: str | None
    target_tokens: int | None
    path: str | None


@dataclass(frozen=True)
class RewardInput:
    """What a reward may read of one response."""

    prompt: str
    response: str
    n_tokens: int
    answer: str | None  # the prompt's reference answer, if the prompt set gives one


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


@functools.lru_cache(maxsize=4)
def load_reward_model(path: str) -> RewardModel:
    """The reward model saved at `path`, loaded once per process (a rollout worker scores every
    batch of its run with it)."""
    return RewardModel.load(Path(path))


def terms_fingerprint(terms: Sequence[Term]) -> str:
    """What a cached reward depends on besides the prompt and response: the terms, and for a
    reward model the files saved at its path (a model retrained into the same directory must not
    be served its predecessor's cached scores)."""
    described = []
    for t in terms:
        d = {"fn": t.fn, "weight": t.weight, "pattern": t.pattern, "target_tokens": t.target_tokens, "path": t.path}
        if t.fn == "reward_model" and t.path:
            d["files"] = sorted(
                (f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in Path(t.path).iterdir() if f.is_file()
            )
        described.append(d)
    return json.dumps(described, sort_keys=True)


def reward_model_scores(term: Term, inputs: Sequence[RewardInput]) -> list[float]:
    """The score the reward model at ``term.path`` gives each (prompt, response)."""
    if not term.path:
        raise ValueError("the reward_model reward needs `path`")
    return load_reward_model(term.path).score([i.prompt for i in inputs], [i.response for i in inputs])


RuleFn = Callable[[Term, str, int, str | None], float]
BatchRewardFn = Callable[[Term, Sequence[RewardInput]], list[float]]


def _each(rule: RuleFn) -> BatchRewardFn:
    """A rule reward applied to each response of a batch."""

    def batch(term: Term, inputs: Sequence[RewardInput]) -> list[float]:
        return [rule(term, i.response, i.n_tokens, i.answer) for i in inputs]

    return batch


REWARD_FUNCTIONS: dict[str, BatchRewardFn] = {
    "exact_match": _each(exact_match),
    "regex": _each(regex_match),
    "length_penalty": _each(length_penalty),
    "reward_model": reward_model_scores,
}


def total_rewards(terms: Sequence[Term], inputs: Sequence[RewardInput]) -> list[float]:
    """The weighted sum of the spec's reward terms for each input; each term scores the whole
    batch at once."""
    if not inputs:
        return []
    totals = [0.0] * len(inputs)
    for term in terms:
        scores = REWARD_FUNCTIONS[term.fn](term, inputs)
        totals = [total + term.weight * score for total, score in zip(totals, scores, strict=True)]
    return totals

