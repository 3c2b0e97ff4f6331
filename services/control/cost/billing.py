"""Each provider's billing rule: what it bills for the seconds a machine ran.

One pure function, ``billed_dollars``, turns a run's ledger into money, entry by entry; the cost
report, the API's cost, the metrics, the scheduler's budget check and the simulator all go through
it, so every consumer shows the same figure for the same entry.

A provider bills machines, the ledger records pods. A pod of the training pool that starts on
the node another one left (a standby handing its warm node to the training job, or the next job
on the node the last one left) runs on the machine already billed: it pays no new minimum, and
the node's seconds between the two pods are billed to the newcomer. ``HANDOVER_SECONDS`` is how
long an emptied node waits before the cluster takes it back (Karpenter's ``consolidateAfter`` in
the chart's training pool); a pod starting later starts a new machine.

A pod that waits for a node (on Kubernetes: no spot capacity of its kind, or a node starting)
is billed from ``NODE_BOOT_SECONDS`` before its node joined the cluster, not from its launch:
until a machine is started for it the provider bills nothing, and a budget must not run out on
capacity that never came (``services.control.scheduler.plan``'s ``DeferEntry``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.domain.names import ROLE_EVAL, ROLE_ROLLOUT, ROLE_STANDBY, ROLE_TRAINING
from services.ports.prices.catalog import InstancePrice, PriceCatalog
from services.ports.state.state_store import LedgerEntry

# Roles whose pods hold a training node.
NODE_ROLES = frozenset({ROLE_TRAINING, ROLE_STANDBY})
HANDOVER_SECONDS = 30.0
# An instance's boot before its node joins the cluster (a GPU node on EKS: about a minute): the
# provider bills it, Kubernetes does not see it.
NODE_BOOT_SECONDS = 60.0
# Float noise in a ledger's start/end (e.g. 299.99999999) must not round up a whole increment.
_EPSILON_S = 1e-6


@dataclass(frozen=True)
class BillingRule:
    increment_seconds: int  # usage is rounded up to a multiple of this
    minimum_seconds: int  # each launch is billed at least this long
    source: str


RULES: dict[str, BillingRule] = {
    # Linux on-demand and spot instances: per second, with a 60 s minimum each time an instance
    # starts (aws.amazon.com/ec2/pricing/on-demand, "Per Second Billing"; since 2017-10-02).
    "aws": BillingRule(1, 60, "aws.amazon.com/ec2/pricing/on-demand (per-second billing, 60 s minimum)"),
    # VMs (vCPUs, GPUs, memory): per second after a 1-minute minimum
    # (cloud.google.com/compute/vm-instance-pricing, "Billing model for Compute Engine resources").
    "gcp": BillingRule(1, 60, "cloud.google.com/compute/vm-instance-pricing"),
    # ECS pay-as-you-go: per second since 2017-09-28 (alibabacloud.com/notice/ECS-0928), settled
    # hourly. Alibaba's pay-as-you-go page (alibabacloud.com/help/en/ecs/pay-as-you-go-1) adds a
    # minimum duration per hourly cycle that depends on the vCPU count; its figures are not
    # recorded here, so the 60 s minimum is an estimate.
    "alibaba": BillingRule(1, 60, "alibabacloud.com/notice/ECS-0928; minimum: an estimate"),
}
# A provider without a known rule: billed per started minute (the coarser of the common rules).
PER_MINUTE = BillingRule(60, 60, "no known rule for this provider: per started minute assumed")


@dataclass(frozen=True)
class RolloutTerms:
    """How a run's rollout workers and eval pods share their nodes: each uses ``gpus_per_worker``
    of its node's GPUs (``rollout.gpus_per_worker``), and a node of G GPUs holds G / gpus_per_worker
    of them, each billed its share of the node. (A node the run's pods do not fill is billed whole
    by its provider; the share counts only the part its pods use.)"""

    gpus_per_worker: int = 1

    @classmethod
    def of_stored(cls, spec: Mapping[str, Any]) -> RolloutTerms:
        """The terms of a stored run spec (one GPU per worker for a run stored before ``rollout.gpus_per_worker``)."""
        return cls(spec.get("rollout", {}).get("gpus_per_worker", 1))

    def share(self, role: str, price: InstancePrice) -> float:
        """The share of its node's price a pod of ``role`` on an instance type priced ``price``
        is billed: a rollout worker's or eval pod's GPUs of the node's; any other pod holds its node."""
        return self.gpus_per_worker / price.gpus if role in (ROLE_ROLLOUT, ROLE_EVAL) else 1.0


ONE_GPU_PER_WORKER = RolloutTerms()  # the run spec's default


def rule_for(provider: str) -> BillingRule:
    return RULES.get(provider, PER_MINUTE)


def billed_seconds(seconds: float, rule: BillingRule) -> float:
    """The seconds a provider bills for ``seconds`` of running (nothing for a machine that never ran)."""
    if seconds <= 0:
        return 0.0
    increments = math.ceil(seconds / rule.increment_seconds - _EPSILON_S)
    return float(max(rule.minimum_seconds, increments * rule.increment_seconds))


def billed_dollars(entries: Sequence[LedgerEntry], catalog: PriceCatalog, now: float) -> list[float]:
    """What each of a run's ledger ``entries`` costs under its provider's rule, at the price it was
    opened with (an open entry up to ``now``), in its instance type's currency; entries of one
    machine (see the module's docstring) share its minimum, and the machine's idle seconds between
    them are billed to the later one."""
    dollars = [0.0] * len(entries)
    for machine in _machines(entries, now):
        first = entries[machine[0]]
        rule = rule_for(catalog.get(first.instance_type).provider)
        start, end = first.started_at, first.started_at
        for i in machine:
            e = entries[i]
            e_end = e.started_at + e.seconds(now)
            dollars[i] = (e_end - end) * e.price_per_hour / 3600.0  # from where the machine's bill stood
            end = e_end
        top_up = billed_seconds(end - start, rule) - (end - start)  # the minimum and rounding, once a machine
        dollars[machine[0]] += top_up * first.price_per_hour / 3600.0
    return dollars


def _machines(entries: Sequence[LedgerEntry], now: float) -> list[list[int]]:
    """Indexes of ``entries`` grouped by the machine they ran on, each group in start order."""
    machines: list[list[int]] = []
    last_of: dict[tuple[str, str, str], list[int]] = {}  # the open chain of each node kind
    for i in sorted(range(len(entries)), key=lambda i: entries[i].started_at):
        e = entries[i]
        kind = (e.run_id, e.instance_type, e.capacity_type)
        chain = last_of.get(kind) if e.role in NODE_ROLES else None
        if chain is not None:
            before = entries[chain[-1]]
            before_end = before.started_at + before.seconds(now)
            if before.ended_at is not None and 0.0 <= e.started_at - before_end <= HANDOVER_SECONDS:
                chain.append(i)
                continue
        machines.append([i])
        if e.role in NODE_ROLES:
            last_of[kind] = machines[-1]
    return machines
