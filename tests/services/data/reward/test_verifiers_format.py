"""The format reward: the R1 structure <think>...</think><answer>...</answer> by default, or a
custom pattern matched in full, never for longer than safe_regex's time limit."""

from __future__ import annotations

import pytest

from services.core.safe_regex import RewardError, RewardTimeoutError
from services.data.reward.verifiers.format import score


@pytest.mark.parametrize(
    "response",
    [
        "<think>6 * 7 = 42</think><answer>42</answer>",
        "<think>\n6 * 7 = 42\n</think>\n<answer>\n42\n</answer>",  # open-r1's layout
        "  <think>a < b, so b</think>\n\n<answer>b</answer>\n",  # whitespace around; a '<' in the reasoning
    ],
)
def test_the_think_answer_structure_scores_one(response: str) -> None:
    assert score(response) == 1.0


@pytest.mark.parametrize(
    "response",
    [
        "",
        "42",
        "<answer>42</answer>",  # no reasoning
        "<think>6 * 7 = 42</think>",  # no answer
        "<think>6 * 7 = 42<answer>42</answer>",  # reasoning never closed
        "<answer>42</answer><think>6 * 7 = 42</think>",  # wrong order
        "Sure! <think>6 * 7</think><answer>42</answer>",  # text before
        "<think>6 * 7</think><answer>42</answer> Hope that helps.",  # text after
        "<think>6 * 7</think> so: <answer>42</answer>",  # text between
        "<think>6 * 7</think><answer>42</answer><answer>41</answer>",  # a second answer
        "<think>a<think>b</think></think><answer>42</answer>",  # nested reasoning
        "<think>6 * 7</think><answer>42</answer>\n<think>more</think><answer>43</answer>",
    ],
)
def test_other_responses_score_zero(response: str) -> None:
    assert score(response) == 0.0


@pytest.mark.parametrize(
    ("pattern", "response", "expected"),
    [
        (r"Answer: \d+", "Answer: 42", 1.0),
        (r"Answer: \d+", "Answer: 42 apples", 0.0),  # in full, not a prefix
        (r"Answer: \d+", "So. Answer: 42", 0.0),  # nor a suffix
        (r"Answer: \d+$", "Answer: 42\n", 0.0),  # `$` does not excuse the final newline: the whole text must match
        (r"(?s)<reasoning>.*</reasoning>\s*Answer: \d+", "<reasoning>\n6 * 7\n</reasoning>\nAnswer: 42", 1.0),
        (r"a|b", "b", 1.0),  # an alternation is anchored as a whole
        (r"a|b", "ab", 0.0),
        ("(?x) Answer: \\ \\d+  # the number", "Answer: 42", 1.0),  # a verbose pattern ending in a comment
    ],
)
def test_a_custom_pattern_must_match_the_whole_response(pattern: str, response: str, expected: float) -> None:
    assert score(response, pattern) == expected


def test_a_backtracking_pattern_raises_a_timeout_instead_of_hanging() -> None:
    with pytest.raises(RewardTimeoutError):
        score("a" * 2000 + "b", r"(a|aa)+")  # exponential in the engine too


def test_a_pattern_that_does_not_compile_is_a_reward_error() -> None:
    with pytest.raises(RewardError, match="does not compile"):
        score("text", "(")
