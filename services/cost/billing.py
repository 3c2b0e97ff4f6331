"""Each provider's billing rule: what it bills for the seconds a machine ran.

One pure function, ``billed_dollars``, turns a ledger entry into money; the cost report (and
so the API's cost, the metrics and the simulator, which all go through it) uses it, so every
consumer shows the same figure for the same entry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.backends.state_store import LedgerEntry
from services.cost.catalog import PriceCatalog

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


def rule_for(provider: str) -> BillingRule:
    return RULES.get(provider, PER_MINUTE)


def billed_seconds(seconds: float, rule: BillingRule) -> float:
    """The seconds a provider bills for ``seconds`` of running (nothing for a machine that never ran)."""
    if seconds <= 0:
        return 0.0
    increments = math.ceil(seconds / rule.increment_seconds - _EPSILON_S)
    return float(max(rule.minimum_seconds, increments * rule.increment_seconds))


def billed_dollars(entry: LedgerEntry, catalog: PriceCatalog, now: float) -> float:
    """What ``entry`` costs under its provider's rule, at the price it was opened with (an open
    entry up to ``now``). In the currency of its instance type's price."""
    rule = rule_for(catalog.get(entry.instance_type).provider)
    return billed_seconds(entry.seconds(now), rule) * entry.price_per_hour / 3600.0
