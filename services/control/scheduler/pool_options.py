"""Where a run's spot rollout workers go among its pool's options (``rollout.options``: instance
types and zones, each with its own spot capacity and price).

A worker waiting for a node past a node's boot (``NODE_BOOT_SECONDS``) says its option has no
capacity now; a younger one is on its way to a node, counted as on one (on Kubernetes every new pod
waits until its node joins). ``place_spot`` decides, each tick, for the workers the pool lacks on
nodes (its *need*):

- while some option has no worker waiting, each option keeps one waiting worker at most (its
  oldest: a probe, which takes the option's capacity when it comes; the others are stopped), and
  the need not covered by probes younger than the patience is launched on the cheapest such
  option (by spot price per hour now). A probe that has waited longer no longer counts: its
  worker is replaced where capacity may be;
- once every option has one waiting, no more are launched than the pool lacks, and the waiting
  workers are kept up to the need, or one per option if that is more (so that stopping one does
  not free its option for a launch the next tick);
- once the pool has its size on nodes, every waiting worker is stopped, and the dearest options'
  newest workers go first when it is larger.

A one-option pool (``instance_type`` alone) works as the pool always has: workers launched up to
its size, waiting ones counted in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.control.cost.billing import NODE_BOOT_SECONDS, RolloutTerms
from services.domain.names import ROLE_ROLLOUT
from services.domain.runspec import RunSpec
from services.ports.launcher.launcher import PodStatus
from services.ports.prices.catalog import PriceCatalog

OPTION_LABEL = "option"  # a rollout pod's label: the index of its option in ``RolloutPool.choices``


def option_of(pod: PodStatus) -> int:
    """The pool option a worker runs on (0, ``instance_type`` in any zone, for one launched without)."""
    return int(pod.labels.get(OPTION_LABEL, "0"))


def worker_prices(spec: RunSpec, catalog: PriceCatalog) -> tuple[float, ...]:
    """Each option's spot price of one worker: its share of a node (``RolloutTerms``), so that an
    option of 4-GPU nodes compares with one of 1-GPU nodes per worker, not per node."""
    terms = RolloutTerms(spec.rollout.gpus_per_worker)
    prices = [catalog.get(o.instance_type) for o in spec.rollout.choices]
    return tuple(price.spot * terms.share(ROLE_ROLLOUT, price) for price in prices)


def cheapest_free(prices: Sequence[float], waiting: Sequence[PodStatus]) -> int | None:
    """The cheapest option where none of the ``waiting`` workers waits (the first of equal ones); None if every one has one."""
    taken = {option_of(w) for w in waiting}
    free = [i for i in range(len(prices)) if i not in taken]
    return min(free, key=lambda i: prices[i]) if free else None


def cheapest(prices: Sequence[float]) -> int:
    return min(range(len(prices)), key=lambda i: prices[i])


def keep_order(prices: Sequence[float], workers: Sequence[PodStatus]) -> list[PodStatus]:
    """``workers`` in the order they are kept when the pool shrinks: on a node before waiting, the
    cheaper option before the dearer, then as given (oldest slot first)."""
    return sorted(workers, key=lambda w: (w.waiting_for_node, prices[option_of(w)] if prices else 0.0))


@dataclass(frozen=True)
class Placement:
    """This tick's change to a spot pool: ``launch`` new workers on option ``option``; stop ``stop``."""

    launch: int
    option: int
    stop: list[PodStatus]


def place_spot(
    prices: Sequence[float], pool: Sequence[PodStatus], size: int, now: float, patience_s: float
) -> Placement:
    """Hold ``size`` spot workers on nodes among the options priced ``prices`` (module docstring)."""
    waiting = [w for w in pool if w.waiting_for_node and now - w.started_at >= NODE_BOOT_SECONDS]
    held = [w for w in pool if w not in waiting]  # on a node, or on its way to one
    need = size - len(held)
    if need <= 0:
        return Placement(0, cheapest(prices), keep_order(prices, held)[size:] + waiting)
    probes: dict[int, PodStatus] = {}
    for w in sorted(waiting, key=lambda w: w.started_at):
        probes.setdefault(option_of(w), w)
    others = [w for w in waiting if w not in probes.values()]
    free = cheapest_free(prices, waiting)
    if free is None:
        kept = keep_order(prices, list(probes.values())) + keep_order(prices, others)
        return Placement(max(0, need - len(waiting)), cheapest(prices), kept[max(need, len(probes)) :])
    young = sum(now - w.started_at < patience_s for w in probes.values())
    return Placement(max(0, need - young), free, others)
