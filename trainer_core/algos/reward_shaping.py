"""Reward shaping on the data side of an update. Pure torch."""

from __future__ import annotations

from torch import Tensor


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int, penalty: float) -> Tensor:
    """DAPO's overlong reward shaping (Yu et al. 2025, arXiv 2503.14476, eq. 13; verl
    `DAPORewardManager`): 0 up to max_new_tokens - buffer tokens, then falling linearly to
    -penalty at max_new_tokens, `(batch,)` of response `lengths` `(batch,)`. buffer 0 is off."""
    if buffer == 0:
        return lengths.new_zeros(lengths.shape)
    exceed = lengths - (max_new_tokens - buffer)
    return (-exceed / buffer * penalty).clamp(max=0)
