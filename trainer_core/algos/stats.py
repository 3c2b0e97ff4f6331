"""Masked statistics over response tokens, and the clamp on log-ratios that every `exp` of one
takes. Shapes: `(batch, response_len)` with `mask` 1 on real tokens."""

from __future__ import annotations

import torch
from torch import Tensor

# Log-ratios are clamped before exp(): a stale or badly-off sample must not overflow to inf
# and poison the whole batch (verl clamps likewise).
MAX_LOG_RATIO = 20.0


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over positions where `mask` is 1; 0 where the mask is empty."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp_min(1e-8)
    return (x * mask).sum(dim) / mask.sum(dim).clamp_min(1e-8)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """`x` shifted and scaled to zero mean, unit (unbiased) variance over the masked positions."""
    mean = masked_mean(x, mask)
    centered = x - mean
    count = mask.sum()
    var = masked_mean(centered**2, mask) * count / (count - 1).clamp_min(1)
    return centered * torch.rsqrt(var + eps)
