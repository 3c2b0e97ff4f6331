from __future__ import annotations

import pytest

from services.reward.functions import RewardInput, last_number, total_rewards
from services.runspec import RewardTerm


@pytest.mark.parametrize(
    ("text", "expected"),
    [("The answer is 42.", 42.0), ("3 + 4 = 7", 7.0), ("-5", -5.0), ("1,234 apples", 1234.0), ("none", None), ("2.50", 2.5)],
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
