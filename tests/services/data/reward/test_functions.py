from __future__ import annotations

import pytest

from services.data.reward.functions import REWARD_FUNCTIONS, RewardInput, last_number, score_batch, total_rewards
from services.domain.reward_spec import RewardFn, RewardTerm


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 42.", 42.0),
        ("3 + 4 = 7", 7.0),
        ("-5", -5.0),
        ("1,234 apples", 1234.0),
        ("none", None),
        ("2.50", 2.5),
    ],
)
def test_last_number(text: str, expected: float | None) -> None:
    assert last_number(text) == expected


def total_reward(terms: list[RewardTerm], response: str, n_tokens: int, answer: str | None) -> float:
    return total_rewards(terms, [RewardInput("", response, n_tokens, answer)])[0]


def test_exact_match_compares_last_numbers() -> None:
    terms = [RewardTerm(fn="exact_match")]
    assert total_reward(terms, "13 + 14 = 27", 5, "27") == 1.0
    assert total_reward(terms, "27, no wait, 26", 5, "27") == 0.0
    assert total_reward(terms, "27", 1, None) == 0.0


def test_weighted_sum_of_terms() -> None:
    terms = [
        RewardTerm(fn="exact_match", weight=1.0),
        RewardTerm(fn="regex", pattern=r"^\d+$", weight=0.5),
        RewardTerm(fn="length_penalty", target_tokens=4, weight=2.0),
    ]
    assert total_reward(terms, "27", 2, "27") == 1.5
    # 8 tokens against a target of 4: penalty -(8-4)/4 = -1, weighted -2; format fails.
    assert total_reward(terms, "it is 27", 8, "27") == pytest.approx(1.0 - 2.0)


# A term's failure is its own: the response scores 0.0 for that term and is reported.
BACKTRACKING = r"(\w+\s?)+$"  # exponential on a long word followed by a non-word character


def reward_model_term(weight: float = 1.0) -> RewardTerm:
    return RewardTerm.model_construct(
        fn=RewardFn.REWARD_MODEL, weight=weight, pattern=None, target_tokens=None, path="/rm"
    )


def test_a_regex_that_times_out_scores_0_for_that_response_only() -> None:
    terms = [RewardTerm(fn="exact_match"), RewardTerm(fn="regex", pattern=BACKTRACKING, weight=2.0)]
    inputs = [RewardInput("", "27", 1, "27"), RewardInput("", "27 " + "word" * 500 + "!", 500, "27")]

    scores = score_batch(terms, inputs)

    # The first matches the pattern (1 + 2); the second keeps its exact_match point, the regex adds 0.
    assert scores.totals == [3.0, 1.0]
    assert scores.failed == [False, True]
    assert scores.failures == {"regex:timeout": 1}
    assert (
        scores.reason is not None and scores.reason.startswith("regex: pattern ") and "did not decide" in scores.reason
    )


def test_the_pattern_of_the_report_scores_0_on_a_long_response() -> None:
    """Regression: `([\\s\\S]+)+\\x00` on a ~2000-character response hung the worker under `re`."""
    terms = [RewardTerm(fn="regex", pattern=r"([\s\S]+)+\x00")]
    scores = score_batch(terms, [RewardInput("", "The answer is 42. " * 111, 500, None)])
    assert scores.totals == [0.0]


def test_a_reward_model_that_raises_fails_its_term_for_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(term, inputs):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setitem(REWARD_FUNCTIONS, "reward_model", broken)
    terms = [reward_model_term(), RewardTerm(fn="length_penalty", target_tokens=4)]
    inputs = [RewardInput("p", "a", 4, None), RewardInput("p", "b", 8, None)]

    scores = score_batch(terms, inputs)

    assert scores.totals == [0.0, -1.0]  # the length penalty still counts
    assert scores.failed == [True, True]
    assert scores.failures == {"reward_model:exception": 2}
    assert scores.reason == "reward_model: RuntimeError: CUDA error: out of memory"


@pytest.mark.parametrize(
    ("returned", "totals", "failed", "reason"),
    [
        ([1.0, float("nan")], [1.0, 0.0], [False, True], "not finite"),
        ([1.0], [0.0, 0.0], [True, True], "returned 1 scores for 2 responses"),
    ],
    ids=["nan", "short"],
)
def test_a_score_that_cannot_be_used_is_a_failure(
    monkeypatch: pytest.MonkeyPatch, returned: list[float], totals: list[float], failed: list[bool], reason: str
) -> None:
    monkeypatch.setitem(REWARD_FUNCTIONS, "reward_model", lambda term, inputs: returned)
    scores = score_batch([reward_model_term()], [RewardInput("p", "a", 1, None), RewardInput("p", "b", 1, None)])
    assert scores.totals == totals
    assert scores.failed == failed
    assert scores.reason is not None and reason in scores.reason


def test_total_rewards_scores_a_failure_0_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    terms = [RewardTerm(fn="regex", pattern=BACKTRACKING)]
    assert total_rewards(terms, [RewardInput("", "word" * 500 + "!", 500, None)]) == [0.0]
    assert "1 reward computations failed" in caplog.text


def test_no_failures_no_reason() -> None:
    scores = score_batch(
        [RewardTerm(fn="regex", pattern="yes")], [RewardInput("", "yes", 1, None), RewardInput("", "no", 1, None)]
    )
    assert (scores.totals, scores.failed, scores.failures, scores.reason) == ([1.0, 0.0], [False, False], {}, None)


def test_the_verifiers_score_through_the_run_spec_s_terms() -> None:
    tests = {"inputs": ["2 3\n", "10 -4\n"], "outputs": ["5\n", "6\n"]}
    program = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    think = "<think>2 and 3 make 5</think>\n<answer>\\boxed{5}</answer>"
    scores = score_batch(
        [RewardTerm(fn="math"), RewardTerm(fn="format", weight=0.1)],
        [
            RewardInput("2+3?", think, 9, "5"),
            RewardInput("2+3?", "\\boxed{\\frac{10}{2}}", 9, "5"),
            RewardInput("2+3?", "6", 1, "5"),
        ],
    )
    assert scores.totals == pytest.approx([1.1, 1.0, 0.0])
    code = score_batch(
        [RewardTerm(fn="code")], [RewardInput("add", program, 9, tests), RewardInput("add", "print(5)", 2, tests)]
    )
    assert code.totals == [1.0, 0.5]
    missing = score_batch([RewardTerm(fn="code")], [RewardInput("add", program, 9, None)])
    assert missing.failures == {"code:invalid": 1}
