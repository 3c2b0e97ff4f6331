"""The held-out eval's metrics: pass@k's product form against the plain combinatorial formula
and against counting the k-subsets themselves."""

from __future__ import annotations

import itertools
import math

import pytest

from services.data.rollout.eval_metrics import eval_metrics, pass_at_k


def test_pass_at_k_is_one_minus_the_binomial_ratio() -> None:
    for n in range(1, 21):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12), (
                    n,
                    c,
                    k,
                )


def test_pass_at_k_is_the_share_of_k_subsets_holding_a_pass() -> None:
    passed = [True, False, False, True, False, False]  # n = 6, c = 2
    for k in range(1, 7):
        subsets = list(itertools.combinations(passed, k))
        assert pass_at_k(6, 2, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_pass_at_k_stays_finite_where_the_binomials_are_huge() -> None:
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001)
    assert pass_at_k(1000, 0, 500) == 0.0 and pass_at_k(1000, 600, 500) == 1.0


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_refuses_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_eval_metrics_average_over_prompts_and_always_hold_the_mean() -> None:
    scores = [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.5, 0.0]]  # passes: 1, 0 and 3 of 4
    got = eval_metrics(scores, ["pass@1", "pass@2"])
    assert got["mean"] == pytest.approx(3.5 / 12)
    assert got["pass@1"] == pytest.approx((1 / 4 + 0 + 3 / 4) / 3)
    assert got["pass@2"] == pytest.approx(((1 - math.comb(3, 2) / 6) + 0 + 1) / 3)
    assert set(eval_metrics(scores, ["mean"])) == {"mean"}
