"""The math reward: final answers compared as a grader would, by math-verify in worker processes
that a hostile answer cannot hold for longer than the time limit."""

from __future__ import annotations

import threading
import time

import pytest

from services.data.reward.verifiers.math import DEFAULT_TIMEOUT_S, score


@pytest.mark.parametrize(
    ("response", "ground_truth", "expected"),
    [
        ("So the total is \\boxed{42}.", "42", 1.0),
        ("So the total is \\boxed{41}.", "42", 0.0),
        ("Half of them: $\\boxed{\\frac{1}{2}}$", "0.5", 1.0),  # a fraction against a decimal
        ("The answer is 0.5", "\\frac{1}{2}", 1.0),  # and the other way round, with no box
        ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),  # \dfrac and a plain fraction
        ("\\boxed{0.75}", "3/5", 0.0),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),  # symbolic equality
        ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),
        ("\\boxed{x^2 + 1}", "(x+1)^2", 0.0),
        ("The rope is \\boxed{12\\text{ cm}} long.", "12", 1.0),  # units around the number
        ("The final answer is $\\left( 3, \\frac{\\pi}{2} \\right)$", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
        ("Therefore the answer is \\boxed{5}.", "\\boxed{5}", 1.0),  # a reference given already boxed
    ],
)
def test_equivalent_answers_score_one_and_others_zero(response: str, ground_truth: str, expected: float) -> None:
    assert score(response, ground_truth) == expected


def test_only_the_last_boxed_answer_counts() -> None:
    response = (
        "With 3 boxes of 4 we get \\boxed{12}. No: the box was counted twice. So the answer is \\boxed{8}, not 12 or 3."
    )
    assert score(response, "8") == 1.0
    assert score(response, "12") == 0.0
    assert score(response, "3") == 0.0


@pytest.mark.parametrize(
    ("response", "ground_truth"), [("", "1"), ("   \n", "1"), ("I could not solve it.", "1"), ("\\boxed{1}", "")]
)
def test_no_answer_scores_zero(response: str, ground_truth: str) -> None:
    assert score(response, ground_truth) == 0.0


def test_a_worker_thread_may_score() -> None:
    """math-verify's own timeouts use signal.alarm, which raises outside the main thread."""
    results: list[float] = []
    thread = threading.Thread(target=lambda: results.append(score("\\boxed{\\frac{6}{8}}", "0.75")))
    thread.start()
    thread.join(timeout=60)
    assert results == [1.0]


@pytest.mark.parametrize(
    "response",
    [
        "\\boxed{" + "{" * 50_000 + "}" * 50_000 + "}",  # 100 KB of nested braces
        "The answer is \\boxed{10^{10^{10}}}",  # SymPy would compute all ten billion digits
    ],
    ids=["nested braces", "huge exponent"],
)
def test_a_hostile_response_scores_zero_within_the_time_limit(response: str) -> None:
    score("\\boxed{1}", "1")  # a worker started: the time below is the response's alone
    started = time.monotonic()
    assert score(response, "1") == 0.0
    assert time.monotonic() - started < DEFAULT_TIMEOUT_S + 2.0
    # The worker that was stopped is replaced: the next response is scored.
    assert score("\\boxed{7}", "7") == 1.0
