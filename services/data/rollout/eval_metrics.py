"""Held-out evaluation metrics over scored responses (torch-free, pure).

A response *passes* when its score is above 0: the rule rewards (exact_match, regex, format,
math) score 1 or 0, so for them passing is being right. ``pass@k`` is the chance that at least
one of k responses drawn without replacement from a prompt's n passes, averaged over prompts,
by the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
Code", eq. 1 and its numerically stable form in Figure 3).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

MEAN = "mean"
PASS_AT = re.compile(r"pass@([1-9][0-9]*)")


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): of ``n`` responses of which ``c`` pass, the chance that ``k``
    of them drawn without replacement hold at least one that passes. Computed as the product
    1 - prod_{i = n-c+1}^{n} (1 - k / i), which never forms the (huge) binomials."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    failing = 1.0
    for i in range(n - c + 1, n + 1):
        failing *= 1.0 - k / i
    return 1.0 - failing


def eval_metrics(scores: Sequence[Sequence[float]], names: Sequence[str]) -> dict[str, float]:
    """The metrics ``names`` (``mean``, ``pass@k``) of ``scores``, one list of n responses' scores
    per prompt; ``mean`` (over every response) is always among them."""
    if not scores or any(not s for s in scores):
        raise ValueError("every prompt needs at least one scored response")
    out = {MEAN: sum(map(sum, scores)) / sum(map(len, scores))}
    for name in names:
        m = PASS_AT.fullmatch(name)
        if m is None:
            continue
        k = int(m.group(1))
        out[name] = sum(pass_at_k(len(s), sum(v > 0 for v in s), k) for s in scores) / len(scores)
    return out
