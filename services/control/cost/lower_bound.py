"""The lower bound of a run's bill: what its work could have cost with the levers spotrl has.

Every busy second of each role at the cheapest price that role may run at:

- rollout workers, eval pods and the reward server may run on spot: the cheaper of their
  instance type's spot and on-demand prices;
- training: its on-demand price, or the cheaper of spot and on-demand for a run whose
  ``training.capacity`` lets its jobs run on spot (spot or auto);
- a standby holds a warm training node and does no work: no busy second, nothing.

Busy seconds are paid as they pass, with no billing minimum or rounding, so no schedule of the
same work pays less. The run's report counts a pod's ledger seconds as its busy seconds; the
simulator counts the generation and training seconds its batches needed. Both price them here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from contracts.training import TrainingCapacity
from services.control.cost.billing import RolloutTerms
from services.domain.names import ROLE_EVAL, ROLE_REWARD, ROLE_ROLLOUT, ROLE_STANDBY, ROLE_TRAINING
from services.ports.prices.catalog import InstancePrice, PriceCatalog
from services.ports.state.state_store import LedgerEntry

# What the figure counts, in one line: the API's description of it, and what the report page and
# the CLI print beside it (as ``LOWER_BOUND_DEFINITION``).
LOWER_BOUND_MEANING = (
    "every busy pod-second at the cheapest price its role may run at "
    "(rollout, eval and reward at spot, training on-demand or at spot where the run may train on spot, "
    "a standby's idle node at nothing), no billing minimum"
)
LOWER_BOUND_DEFINITION = f"lower bound: {LOWER_BOUND_MEANING}"
# Roles whose pods may run on spot capacity.
SPOT_ROLES = frozenset({ROLE_ROLLOUT, ROLE_EVAL, ROLE_REWARD})
# A standby pod only keeps a training node warm.
IDLE_ROLES = frozenset({ROLE_STANDBY})


@dataclass(frozen=True)
class TrainingTerms:
    """A run's training instance type, whether its jobs may run on spot, and how many of the
    instance type one job runs on."""

    instance_type: str
    spot: bool = False
    nodes: int = 1

    @classmethod
    def of_stored(cls, spec: Mapping[str, Any]) -> TrainingTerms:
        """The terms of a stored run spec (a run stored before ``training.capacity`` trains on-demand,
        before ``training.nodes`` on one node)."""
        training = spec["training"]
        return cls(
            training["instance_type"],
            training.get("capacity", TrainingCapacity.ON_DEMAND) != "on-demand",
            training.get("nodes", 1),
        )


@dataclass(frozen=True)
class Busy:
    """``seconds`` of work of a pod of ``role`` on an instance type priced ``price``, using
    ``share`` of its node (a rollout worker of some of its node's GPUs: ``RolloutTerms``)."""

    role: str
    seconds: float
    price: InstancePrice
    share: float = 1.0


def cheapest_allowed_price(role: str, price: InstancePrice, training_spot: bool) -> float:
    """Per hour: the cheapest price ``role`` may run at on an instance type priced ``price``
    (``training_spot``: the run's training may run on spot)."""
    if role in IDLE_ROLES:
        return 0.0
    if role in SPOT_ROLES or (role == ROLE_TRAINING and training_spot):
        return price.cheapest()
    return price.on_demand


def lower_bound_dollars(busy: Iterable[Busy], training_spot: bool) -> float:
    """The module's lower bound of the work ``busy``, in its instance types' currency."""
    return sum(b.seconds * b.share * cheapest_allowed_price(b.role, b.price, training_spot) / 3600.0 for b in busy)


def ledger_busy(entries: Sequence[LedgerEntry], catalog: PriceCatalog, now: float, rollout: RolloutTerms) -> list[Busy]:
    """Each ledger entry's seconds (an open one's up to ``now``) as its pod's busy seconds."""
    prices = [catalog.get(e.instance_type) for e in entries]
    return [Busy(e.role, e.seconds(now), p, rollout.share(e.role, p)) for e, p in zip(entries, prices, strict=True)]
