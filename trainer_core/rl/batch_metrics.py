"""Statistics of an update's batch under verl's names: response lengths and how many hit the
length limit, and how much of the returns' variance the critic's values explain."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from contracts.samples import Sample
from contracts.training import TrainConfig
from trainer_core.rl.batch import BatchTensors
from trainer_core.rl.strategy import Strategy


def data_metrics(
    batch: BatchTensors, samples: Sequence[Sample], cfg: TrainConfig, strategy: Strategy
) -> dict[str, float]:
    """`response_length/{mean,max,min,clip_ratio}` (clip ratio: responses of max_new_tokens) and,
    with a critic, `critic/explained_variance` = 1 - var(returns - values) / var(returns) over the
    real tokens (unbiased variances, verl `compute_data_metrics`), all over every rank's samples."""
    device = batch.mask.device
    lengths = torch.tensor([float(len(s.response_ids)) for s in samples], dtype=torch.float64, device=device)
    # One sum and one max over ranks: sums, then the largest and minus the smallest length.
    count, total, clipped = strategy.all_reduce(
        torch.stack(
            [
                torch.tensor(float(len(samples)), dtype=torch.float64, device=device),
                lengths.sum(),
                (lengths >= cfg.max_new_tokens).sum().to(torch.float64),
            ]
        )
    ).tolist()
    longest, minus_shortest = strategy.all_reduce(torch.stack([lengths.max(), -lengths.min()]), op="max").tolist()
    metrics = {
        "response_length/mean": total / count,
        "response_length/max": longest,
        "response_length/min": -minus_shortest,
        "response_length/clip_ratio": clipped / count,
    }
    if batch.old_values is not None:
        real = batch.mask > 0
        returns = batch.returns[real].double()
        diff = returns - batch.old_values[real].double()
        n, s_r, s_r2, s_d, s_d2 = strategy.all_reduce(
            torch.stack([real.sum().double(), returns.sum(), (returns**2).sum(), diff.sum(), (diff**2).sum()])
        ).tolist()
        unbiased_var = lambda s, s2: (s2 - s * s / n) / max(n - 1, 1)  # noqa: E731
        metrics["critic/explained_variance"] = 1.0 - unbiased_var(s_d, s_d2) / (unbiased_var(s_r, s_r2) + 1e-5)
    return metrics
