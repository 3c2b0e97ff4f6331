"""DAPO's dynamic sampling on the rollout side (Yu et al. 2025, arXiv 2503.14476, sec. 3.2;
verl `algorithm.filter_groups`): a group whose samples all got the same reward has zero
group-relative advantage everywhere, so it teaches nothing and only dilutes the batch. The
worker drops it before queueing, and the training batch fills up with informative groups, as
verl's "keep sampling until the batch is full" does in one process."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from contracts.samples import Sample


def informative_groups(samples: Sequence[Sample]) -> tuple[list[list[Sample]], int]:
    """The groups (runs of one `group_id`, in order) whose rewards are not all equal, and the
    number of samples dropped with the others. A group of one is all-equal: it is dropped too."""
    groups = [list(g) for _, g in itertools.groupby(samples, key=lambda s: s.group_id)]
    kept = [g for g in groups if len({s.reward for s in g}) > 1]
    return kept, len(samples) - sum(map(len, kept))
