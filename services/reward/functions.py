"""Built-in rewards, registered by name, and the weighted sum a run's spec asks for.

Rule rewards are pure functions of the response (text and token count) and the prompt's
reference answer. The `reward_model` reward scores (prompt, response) with a trained reward
model (`trainer_core.supervised.reward_model`), loaded once per process and run over a batch at a time;
every registered function therefore scores a batch.

Failures are contained per term: a response whose reward could not be computed for a term (a
regex pattern that timed out, a reward model that raised, a score that is not finite) gets 0.0
for that term, and `score_batch` says which responses failed, how many computations, and why,
so the rollout worker reports them on the run and does not cache those rewards.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from services.reward import safe_regex
from services.reward.service import model_fingerprint, remote_fingerprint, score_remote
from services.reward.safe_regex import RewardError
from trainer_core.supervised.reward_model import Quantize, RewardModel

log = logging.getLogger(__name__)

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class Term(Protocol):
    """The fields of a reward term that the functions read (``services.runspec.RewardTerm``)."""

    fn: str
    weight: float
    pattern: str | None
    target_tokens: int | None
    path: str | None
    url: str | None
    quantize: Quantize | None


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
    """1.0 when ``term.pattern`` matches somewhere in the response (anchor it for format checks),
    as `re.search` decides; RewardTimeoutError when that takes longer than the time limit."""
    return float(safe_regex.search(term.pattern or "", response, safe_regex.DEFAULT_TIMEOUT_S))


def length_penalty(term: Term, response: str, n_tokens: int, answer: str | None) -> float:
    """-(tokens beyond target) / target: 0 up to the target, -1 at twice the target."""
    target = term.target_tokens or 1
    return -max(0, n_tokens - target) / target


@functools.lru_cache(maxsize=4)
def load_reward_model(path: str, quantize: Quantize | None = None) -> RewardModel:
    """The reward model saved at `path`, quantized as `quantize` says, loaded once per process (a
    rollout worker scores every batch of its run with it)."""
    return RewardModel.load(Path(path), quantize=quantize)


def terms_fingerprint(terms: Sequence[Term]) -> str:
    """What a cached reward depends on besides the prompt and response: the terms, and for a
    reward model its files, or those the reward service reports (a model retrained into the same
    directory must not be served its predecessor's cached scores)."""
    described = []
    for t in terms:
        d = {"fn": t.fn, "weight": t.weight, "pattern": t.pattern, "target_tokens": t.target_tokens, "path": t.path, "url": t.url}
        if t.fn == "reward_model":
            try:
                d["files"] = remote_fingerprint(t.url) if t.url else model_fingerprint(Path(t.path or ""))
            except (OSError, httpx.HTTPError, ValueError):
                d["files"] = None  # the model has gone or does not answer: its term fails on every batch, reported there
        if t.quantize:  # a quantized model's scores differ from the full one's (absent otherwise: fingerprints kept)
            d["quantize"] = t.quantize
        described.append(d)
    return json.dumps(described, sort_keys=True)


def reward_model_scores(term: Term, inputs: Sequence[RewardInput]) -> list[float]:
    """The score the reward model at ``term.path``, or the reward service at ``term.url``, gives
    each (prompt, response)."""
    prompts, responses = [i.prompt for i in inputs], [i.response for i in inputs]
    if term.url:
        return score_remote(term.url, prompts, responses)
    if not term.path:
        raise ValueError("the reward_model reward needs `path` or `url`")
    return load_reward_model(term.path, term.quantize).score(prompts, responses)


RuleFn = Callable[[Term, str, int, str | None], float]
# A batch function returns, for each input, its score or the error that kept it from one; it
# may also raise, which fails the whole batch for its term.
BatchRewardFn = Callable[[Term, Sequence[RewardInput]], Sequence[float | RewardError]]


def _each(rule: RuleFn) -> BatchRewardFn:
    """A rule reward applied to each response of a batch; one response's failure is its own."""

    def batch(term: Term, inputs: Sequence[RewardInput]) -> list[float | RewardError]:
        return [_contained(rule, term, i) for i in inputs]

    return batch


def _contained(rule: RuleFn, term: Term, i: RewardInput) -> float | RewardError:
    try:
        return rule(term, i.response, i.n_tokens, i.answer)
    except RewardError as e:
        return e
    except Exception as e:  # reward code is the run's: its failure is reported, never the worker's end
        return RewardError(f"{type(e).__name__}: {e}")


REWARD_FUNCTIONS: dict[str, BatchRewardFn] = {
    "exact_match": _each(exact_match),
    "regex": _each(regex_match),
    "length_penalty": _each(length_penalty),
    "reward_model": reward_model_scores,
}


@dataclass(frozen=True)
class Scores:
    """A batch's rewards, and the computations that failed along the way."""

    totals: list[float]  # per input, the weighted sum of its terms (0.0 for a term that failed)
    failed: list[bool]  # per input: some term failed or timed out for it (its total is not to be cached)
    failures: int  # failed (term, response) computations
    reason: str | None  # why the latest one failed, prefixed with its term's fn; None when none did


def score_batch(terms: Sequence[Term], inputs: Sequence[RewardInput]) -> Scores:
    """The weighted sum of the spec's reward terms for each input, each term scoring the whole
    batch at once; never raises for a reward's failure.

    Example: terms [exact_match, regex] over 3 responses, the pattern timing out on the second:
    totals are each response's exact_match score plus the regex's 1.0 where it matched (0.0 on
    the second), failed = [False, True, False], failures = 1, and reason "regex: pattern '...'
    did not decide a response within 0.5 s". A reward model term that raises instead fails for
    all 3: failures = 3, failed all True.
    """
    totals = [0.0] * len(inputs)
    failed = [False] * len(inputs)
    failures, reason = 0, None
    if not inputs:
        return Scores(totals, failed, failures, reason)
    for term in terms:
        try:
            scores = REWARD_FUNCTIONS[term.fn](term, inputs)
            if len(scores) != len(inputs):
                raise RewardError(f"returned {len(scores)} scores for {len(inputs)} responses")
        except Exception as e:  # the whole term failed (a reward model that cannot load or run)
            error = e if isinstance(e, RewardError) else RewardError(f"{type(e).__name__}: {e}")
            scores = [error] * len(inputs)
        for k, score in enumerate(scores):
            if not isinstance(score, RewardError) and not math.isfinite(score):
                score = RewardError(f"a score that is not finite ({score})")  # would poison the advantages
            if isinstance(score, RewardError):
                failed[k] = True
                failures += 1
                reason = f"{term.fn}: {score}"
            else:
                totals[k] += term.weight * score
    return Scores(totals, failed, failures, reason)


def total_rewards(terms: Sequence[Term], inputs: Sequence[RewardInput]) -> list[float]:
    """`score_batch`'s totals; a failure scores 0.0 for its term and is logged (a caller that
    reports failures on the run, or caches rewards, uses `score_batch`)."""
    scores = score_batch(terms, inputs)
    if scores.failures:
        log.warning("%d reward computations failed and scored 0.0; the latest: %s", scores.failures, scores.reason)
    return scores.totals

