"""Built-in rewards, registered by name, and the weighted sum a run's spec asks for.

Rule rewards are pure functions of the response (text and token count) and the prompt's
reference answer (verl's ground truth), among them the verifiers of ``services.data.reward.verifiers``
(math, code in a sandbox, format). The `reward_model` reward scores (prompt, response) with a
trained reward model (`trainer_core.supervised.reward_model`), loaded once per process and run
over a batch at a time; the `function` reward runs the user's own verl-style ``compute_score``
in a pool of worker processes or a reward service. Every registered function scores a batch.

Failures are contained per term: a response whose reward could not be computed for a term (a
regex pattern that timed out, a reward model that raised, a user's function that hung, a score
that is not finite) gets 0.0 for that term, and `score_batch` says which responses failed, how
many computations by reason, and why, so the rollout worker reports them on the run and does
not cache those rewards.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from contracts.messages import Prompt, PromptMessage, answer_text, prompt_text
from services.core import safe_regex
from services.core.errors import PermanentError
from services.core.safe_regex import RewardError
from services.data.reward.function_pool import FunctionPool
from services.data.reward.service import model_fingerprint, remote_fingerprint, score_remote
from services.data.reward.user_function import Failure, Item, Outcome, UserFunctionError, resolve
from trainer_core.supervised.reward_model import Quantize, RewardModel

log = logging.getLogger(__name__)

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class Term(Protocol):
    """The fields of a reward term that the functions read (``services.domain.reward_spec.RewardTerm``)."""

    fn: str
    weight: float
    pattern: str | None
    target_tokens: int | None
    path: str | None
    url: str | None
    quantize: Quantize | None


@dataclass(frozen=True)
class RewardInput:
    """What a reward may read of one response: verl's ``compute_score`` arguments and the prompt."""

    prompt: Prompt  # text, or chat messages
    response: str  # verl's solution_str
    n_tokens: int
    answer: Any = None  # verl's ground_truth: text or any JSON value, None when the prompt set gives none
    data_source: str | None = None
    extra_info: dict[str, Any] | None = None

    @classmethod
    def of(cls, message: PromptMessage, response: str, n_tokens: int) -> RewardInput:
        return cls(message.prompt, response, n_tokens, message.answer, message.data_source, message.extra_info)


def reward_key(i: RewardInput) -> str:
    """Everything a reward reads of `i`, as one string: with the terms' fingerprint, the key of
    its cached reward."""
    return json.dumps([i.prompt, i.answer, i.data_source, i.extra_info, i.response, i.n_tokens], sort_keys=True)


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (commas as thousands separators allowed), else None."""
    found = _NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


def exact_match(term: Term, i: RewardInput) -> float:
    """1.0 when the response's last number equals the answer's last number (the GSM8K convention)."""
    answer = answer_text(i.answer)
    if answer is None:
        return 0.0
    want, got = last_number(answer), last_number(i.response)
    return float(want is not None and got is not None and abs(want - got) < 1e-9)


def regex_match(term: Term, i: RewardInput) -> float:
    """1.0 when ``term.pattern`` matches somewhere in the response (anchor it for format checks),
    as `re.search` decides; RewardTimeoutError when that takes longer than the time limit."""
    return float(safe_regex.search(term.pattern or "", i.response, safe_regex.DEFAULT_TIMEOUT_S))


def length_penalty(term: Term, i: RewardInput) -> float:
    """-(tokens beyond target) / target: 0 up to the target, -1 at twice the target."""
    target = term.target_tokens or 1
    return -max(0, i.n_tokens - target) / target


def math_equivalence(term: Term, i: RewardInput) -> float:
    """1.0 when the response's final answer equals the reference as a grader means it (boxed
    answers, LaTeX, fractions), as math-verify decides (``verifiers.math``)."""
    from services.data.reward.verifiers import math as verify_math  # on first use: it loads sympy, a second or more

    answer = answer_text(i.answer)
    return 0.0 if answer is None else verify_math.score(i.response, answer)


def code_tests(term: Term, i: RewardInput) -> float:
    """The fraction of the item's test cases (its answer) the response's program passes, run in
    the sandbox (``verifiers.code``)."""
    if i.answer is None:
        raise RewardError("the code reward needs the prompt's test cases as its answer", kind="invalid")
    from services.data.reward.verifiers import code as verify_code

    return verify_code.score(i.response, i.answer)


def follows_format(term: Term, i: RewardInput) -> float:
    """1.0 when the response follows the declared structure: ``term.pattern`` in full, else
    <think>...</think> then <answer>...</answer> (``verifiers.format``)."""
    from services.data.reward.verifiers import format as verify_format

    return verify_format.score(i.response, term.pattern)


@functools.lru_cache(maxsize=4)
def load_reward_model(path: str, quantize: Quantize | None = None) -> RewardModel:
    """The reward model saved at `path`, quantized as `quantize` says, loaded once per process (a
    rollout worker scores every batch of its run with it)."""
    return RewardModel.load(Path(path), quantize=quantize)


_pools: dict[str, FunctionPool] = {}


def function_pool(reference: str) -> FunctionPool:
    """The started pool running the user's function ``reference`` (file.py:name), one per process
    until `close_pools`; UserFunctionError when it does not import, is missing or has the wrong
    signature."""
    if reference not in _pools:
        _pools[reference] = FunctionPool(resolve(reference)).start()
    return _pools[reference]


def close_pools() -> None:
    """Stop the worker processes of every user's function this process started."""
    while _pools:
        _pools.popitem()[1].close()


def prepare_terms(terms: Sequence[Term]) -> None:
    """Load what the terms run in this process before the first batch: a user's function that
    cannot be served fails the run at once with the reason (PermanentError), not response by
    response."""
    for t in terms:
        if t.fn == "function" and t.path:
            try:
                function_pool(t.path)
            except UserFunctionError as e:
                raise PermanentError(f"reward function {t.path}: {e}") from None


def function_scores(term: Term, inputs: Sequence[RewardInput]) -> list[Scored | RewardError]:
    """What the user's verl-style ``compute_score`` says of each response: run by the pool of
    worker processes of this one (``term.path``) or by the reward service at ``term.url``."""
    if term.url:
        try:
            remote = score_remote(
                term.url,
                [prompt_text(i.prompt) for i in inputs],
                [i.response for i in inputs],
                data_sources=[i.data_source for i in inputs],
                ground_truths=[i.answer for i in inputs],
                extra_infos=[i.extra_info for i in inputs],
            )
        except httpx.HTTPError as e:
            raise RewardError(f"the reward service does not answer ({type(e).__name__})", kind="unavailable") from None
        outcomes = [
            Outcome(score, metrics, Failure(f) if f else None)
            for score, f, metrics in zip(remote, remote.failures, remote.metrics, strict=True)
        ]
    else:
        outcomes = function_pool(term.path or "").score(
            [Item(i.response, i.answer, i.data_source or "", i.extra_info) for i in inputs]
        )
    return [
        RewardError(f"the reward function's call ended in {o.failure.value}", kind=o.failure.value)
        if o.failure
        else Scored(o.score, o.metrics or {})
        for o in outcomes
    ]


def terms_fingerprint(terms: Sequence[Term]) -> str:
    """What a cached reward depends on besides the prompt and response: the terms, and for a
    reward model or a user's function the fingerprint of its files, or the one the reward service
    reports, in place of where it is (a model retrained into the same directory, or an edited
    function file, must not be served its predecessor's cached scores; the same file, run in the
    worker or served by a reward server, is the same reward)."""
    described = []
    for t in terms:
        d = {
            "fn": t.fn,
            "weight": t.weight,
            "pattern": t.pattern,
            "target_tokens": t.target_tokens,
            "path": t.path,
            "url": t.url,
        }
        if t.fn in ("reward_model", "function"):
            try:
                if t.url:
                    d["files"] = remote_fingerprint(t.url)
                else:
                    d["files"] = (
                        model_fingerprint(Path(t.path or ""))
                        if t.fn == "reward_model"
                        else resolve(t.path or "").fingerprint
                    )
            except (OSError, httpx.HTTPError, ValueError):
                d["files"] = None  # gone or not answering: its term fails on every batch, reported there
            if d["files"] is not None:  # the content decides, not where it is served from (a restarted server moves)
                del d["path"], d["url"]
        if t.quantize:  # a quantized model's scores differ from the full one's (absent otherwise: fingerprints kept)
            d["quantize"] = t.quantize
        described.append(d)
    return json.dumps(described, sort_keys=True)


def reward_model_scores(term: Term, inputs: Sequence[RewardInput]) -> list[float]:
    """The score the reward model at ``term.path``, or the reward service at ``term.url``, gives
    each (prompt, response)."""
    prompts, responses = [prompt_text(i.prompt) for i in inputs], [i.response for i in inputs]
    if term.url:
        return score_remote(term.url, prompts, responses)
    if not term.path:
        raise ValueError("the reward_model reward needs `path` or `url`")
    return load_reward_model(term.path, term.quantize).score(prompts, responses)


@dataclass(frozen=True)
class Scored:
    """A score with the figures a reward reported beside it (a user's function returning a dict)."""

    value: float
    metrics: dict[str, float]


RuleFn = Callable[[Term, RewardInput], float]
# A batch function returns, for each input, its score or the error that kept it from one; it
# may also raise, which fails the whole batch for its term.
BatchRewardFn = Callable[[Term, Sequence[RewardInput]], Sequence[float | Scored | RewardError]]


def _each(rule: RuleFn) -> BatchRewardFn:
    """A rule reward applied to each response of a batch; one response's failure is its own."""

    def batch(term: Term, inputs: Sequence[RewardInput]) -> list[float | RewardError]:
        return [_contained(rule, term, i) for i in inputs]

    return batch


def _contained(rule: RuleFn, term: Term, i: RewardInput) -> float | RewardError:
    try:
        return rule(term, i)
    except RewardError as e:
        return e
    except Exception as e:  # a reward's failure is reported on the run, never the worker's end
        return RewardError(f"{type(e).__name__}: {e}", kind="exception")


REWARD_FUNCTIONS: dict[str, BatchRewardFn] = {
    "exact_match": _each(exact_match),
    "regex": _each(regex_match),
    "length_penalty": _each(length_penalty),
    "math": _each(math_equivalence),
    "code": _each(code_tests),
    "format": _each(follows_format),
    "reward_model": reward_model_scores,
    "function": function_scores,
}


@dataclass(frozen=True)
class Scores:
    """A batch's rewards, and the computations that failed along the way."""

    totals: list[float]  # per input, the weighted sum of its terms (0.0 for a term that failed)
    failed: list[bool]  # per input: some term failed or timed out for it (its total is not to be cached)
    metrics: list[dict[str, float]]  # per input, what its terms reported beside their scores
    failures: Counter[str]  # failed (term, response) computations by "<fn>:<kind>"
    reason: str | None  # why the latest one failed, prefixed with its term's fn; None when none did


def score_batch(terms: Sequence[Term], inputs: Sequence[RewardInput]) -> Scores:
    """The weighted sum of the spec's reward terms for each input, each term scoring the whole
    batch at once; never raises for a reward's failure.

    Example: terms [exact_match, regex] over 3 responses, the pattern timing out on the second:
    totals are each response's exact_match score plus the regex's 1.0 where it matched (0.0 on
    the second), failed = [False, True, False], failures = {"regex:timeout": 1}, and reason
    "regex: pattern '...' did not decide a response within 0.5 s". A reward model term that
    raises instead fails for all 3: failures = {"reward_model:exception": 3}, failed all True.
    """
    totals = [0.0] * len(inputs)
    failed = [False] * len(inputs)
    metrics: list[dict[str, float]] = [{} for _ in inputs]
    failures: Counter[str] = Counter()
    reason = None
    if not inputs:
        return Scores(totals, failed, metrics, failures, reason)
    for term in terms:
        try:
            scores = REWARD_FUNCTIONS[term.fn](term, inputs)
            if len(scores) != len(inputs):
                raise RewardError(f"returned {len(scores)} scores for {len(inputs)} responses", kind="invalid")
        except Exception as e:  # the whole term failed (a reward model that cannot load or run)
            error = e if isinstance(e, RewardError) else RewardError(f"{type(e).__name__}: {e}")
            scores = [error] * len(inputs)
        for k, score in enumerate(scores):
            if isinstance(score, Scored):
                metrics[k].update(score.metrics)
                score = score.value
            if not isinstance(score, RewardError) and not math.isfinite(score):
                score = RewardError(
                    f"a score that is not finite ({score})", kind="invalid"
                )  # would poison the advantages
            if isinstance(score, RewardError):
                failed[k] = True
                failures[f"{term.fn}:{score.kind}"] += 1
                reason = f"{term.fn}: {score}"
            else:
                totals[k] += term.weight * score
    return Scores(totals, failed, metrics, failures, reason)


def total_rewards(terms: Sequence[Term], inputs: Sequence[RewardInput]) -> list[float]:
    """`score_batch`'s totals; a failure scores 0.0 for its term and is logged (a caller that
    reports failures on the run, or caches rewards, uses `score_batch`)."""
    scores = score_batch(terms, inputs)
    if scores.failures:
        log.warning(
            "%d reward computations failed and scored 0.0; the latest: %s", scores.failures.total(), scores.reason
        )
    return scores.totals
