"""training.capacity: the capacity rule (services.control.scheduler.spot_training) and what plan does
with it: spot launches, preempted jobs started again without a failure counted, auto giving a
spot node up."""

from __future__ import annotations

import dataclasses

from services.control.scheduler.plan import (
    LaunchStandby,
    LaunchTraining,
    ReapPod,
    RecordTrainingFailure,
    RefuseSpotTraining,
    StopPod,
    plan,
)
from services.control.scheduler.policies import Estimates
from services.control.scheduler.pool_options import OPTION_LABEL
from services.control.scheduler.spot_training import (
    ANY_ZONE,
    PATIENCE_STARTUPS,
    PRIOR_SPOT_SECONDS,
    SPOT_RETRY_AFTER_SECONDS,
    SpotTrainingRecord,
    TrainingPrices,
    give_up_zone,
    spot_loss,
    spot_wait_expired,
    spot_zone,
    spot_zones,
)
from services.domain.runspec import RunSpec
from services.ports.launcher.launcher import PodOutcome, PodPhase
from services.ports.state.state_store import LedgerEntry
from tests.services.control.scheduler.test_plan import NOW, SPEC, T1, pod, run, seen

PRICES = TrainingPrices(spot=(9.90,), on_demand=21.96)  # p4d.24xlarge per hour, as the catalog has it
ESTIMATES = Estimates(rollout_samples_per_s=1.0, training_seconds=1080.0, startup_seconds=90.0)


def spec(capacity: str) -> RunSpec:
    return SPEC.model_copy(update={"training": SPEC.training.model_copy(update={"capacity": capacity})})


def test_on_demand_and_spot_are_what_they_say() -> None:
    for capacity, zone in (("on-demand", None), ("spot", 0)):
        assert spot_zone(spec(capacity), NOW, {}, ESTIMATES, PRICES, SpotTrainingRecord()) == zone
        # Neither weighs prices, preemptions or a refusal: spot waits for its node however long.
        assert spot_zone(spec(capacity), NOW, {ANY_ZONE: NOW}, ESTIMATES, None, SpotTrainingRecord(50, 60.0)) == zone


def test_auto_takes_spot_while_its_expected_cost_is_lower() -> None:
    auto = spec("auto")
    assert spot_zone(auto, NOW, {}, ESTIMATES, PRICES, SpotTrainingRecord()) == 0
    # Spot at the on-demand price: even with no preemption expected, nothing to gain.
    same = TrainingPrices(spot=(21.96,), on_demand=21.96)
    assert spot_zone(auto, NOW, {}, ESTIMATES, same, SpotTrainingRecord()) is None
    # Each preemption costs a start-up and half a checkpoint interval (90 + 150 s). At 9.90 against
    # 21.96 spot pays while the rate is below (21.96 / 9.90 - 1) / 240 s: about 0.0051 a second.
    lost = ESTIMATES.startup_seconds + auto.training.checkpoint_every_s / 2
    breakeven = (PRICES.on_demand / PRICES.spot[0] - 1) / lost
    seconds = 3600.0
    below = SpotTrainingRecord(preemptions=int(0.9 * breakeven * (seconds + PRIOR_SPOT_SECONDS)), seconds=seconds)
    above = SpotTrainingRecord(preemptions=int(1.1 * breakeven * (seconds + PRIOR_SPOT_SECONDS)) + 1, seconds=seconds)
    assert spot_zone(auto, NOW, {}, ESTIMATES, PRICES, below) == 0
    assert spot_zone(auto, NOW, {}, ESTIMATES, PRICES, above) is None
    # Without a price to weigh, the safe side.
    assert spot_zone(auto, NOW, {}, ESTIMATES, None, SpotTrainingRecord()) is None


def test_auto_trains_on_demand_for_a_while_after_giving_a_spot_node_up() -> None:
    auto = spec("auto")
    refused = NOW - SPOT_RETRY_AFTER_SECONDS + 1
    assert spot_zone(auto, NOW, {ANY_ZONE: refused}, ESTIMATES, PRICES, SpotTrainingRecord()) is None
    assert spot_zone(auto, NOW + 1, {ANY_ZONE: refused}, ESTIMATES, PRICES, SpotTrainingRecord()) == 0


def test_the_record_counts_the_spot_training_pods_preempted_and_their_seconds() -> None:
    def entry(pod: str, role: str, capacity: str, outcome: str | None, ended_at: float | None) -> LedgerEntry:
        return LedgerEntry(0, "r", role, pod, "p4d.24xlarge", capacity, 9.9, "catalog", 100.0, ended_at, outcome)

    ledger = [
        entry("r-train-1", "training", "spot", PodOutcome.PREEMPTED.value, 400.0),
        entry("r-train-1b", "training", "spot", None, None),  # still running at 1000
        entry("r-train-0", "training", "on-demand", PodOutcome.PREEMPTED.value, 400.0),
        entry("r-rollout-0", "rollout", "spot", PodOutcome.PREEMPTED.value, 400.0),
    ]
    record = SpotTrainingRecord.of(ledger, now=1000.0)
    assert record == SpotTrainingRecord(preemptions=1, seconds=300.0 + 900.0)
    assert record.preemptions_per_second == 1 / (1200.0 + PRIOR_SPOT_SECONDS)


SPOT_T1 = dataclasses.replace(T1, instance_type="p4d.24xlarge")
WAITING_T1 = dataclasses.replace(SPOT_T1, waiting_for_node=True, started_at=NOW - PATIENCE_STARTUPS * 90.0 - 1)


def test_only_a_spot_pod_that_never_had_a_node_past_its_patience_has_waited_too_long() -> None:
    assert spot_wait_expired(WAITING_T1, NOW, ESTIMATES)
    assert not spot_wait_expired(dataclasses.replace(WAITING_T1, started_at=NOW - 100), NOW, ESTIMATES)
    assert not spot_wait_expired(dataclasses.replace(WAITING_T1, capacity_type="on-demand"), NOW, ESTIMATES)
    assert not spot_wait_expired(dataclasses.replace(WAITING_T1, node_joined_at=NOW - 400), NOW, ESTIMATES)
    assert not spot_wait_expired(SPOT_T1, NOW, ESTIMATES)


def test_a_spot_job_of_several_nodes_waits_until_it_has_them_all() -> None:
    """Two nodes, one of which came: billed, not started; past its patience it is given up like a
    job no node came for, and its end counts no failure."""
    partly = dataclasses.replace(
        WAITING_T1, nodes=2, waiting_for_node=False, node_joined_at=NOW - 400, partly_placed=True
    )
    assert spot_wait_expired(partly, NOW, ESTIMATES)
    assert not spot_wait_expired(dataclasses.replace(partly, partly_placed=False), NOW, ESTIMATES)
    stopped = dataclasses.replace(partly, phase=PodPhase.FAILED, exit_code=-15, ended_at=NOW)
    assert spot_loss(stopped) and not spot_loss(dataclasses.replace(stopped, partly_placed=False))


def test_the_last_zone_is_given_up_by_auto_only_and_not_while_the_rollout_waits_too() -> None:
    assert give_up_zone(spec("auto"), 0, {}, NOW, rollout_stalled=False)
    assert not give_up_zone(spec("spot"), 0, {}, NOW, rollout_stalled=False)  # spot waits
    # While the run's spot rollout waits for nodes too, on-demand training would buy no time.
    assert not give_up_zone(spec("auto"), 0, {}, NOW, rollout_stalled=True)


def zoned(capacity: str, *zones: str) -> RunSpec:
    training = SPEC.training.model_copy(update={"capacity": capacity, "spot_zones": list(zones)})
    return SPEC.model_copy(update={"training": training})


def test_a_spot_job_goes_to_the_cheapest_zone_not_given_up() -> None:
    three = zoned("auto", "us-east-1a", "us-east-1b", "us-east-1c")
    assert spot_zones(three) == ["us-east-1a", "us-east-1b", "us-east-1c"]
    assert spot_zones(spec("auto")) == [ANY_ZONE]
    prices = TrainingPrices(spot=(9.90, 8.10, 12.0), on_demand=21.96)
    record = SpotTrainingRecord()
    assert spot_zone(three, NOW, {}, ESTIMATES, prices, record) == 1
    assert spot_zone(three, NOW, {"us-east-1b": NOW - 60}, ESTIMATES, prices, record) == 0
    # A zone given up is tried again after SPOT_RETRY_AFTER_SECONDS.
    long_ago = NOW - SPOT_RETRY_AFTER_SECONDS
    assert spot_zone(three, NOW, {"us-east-1b": long_ago}, ESTIMATES, prices, record) == 1
    # Every zone given up: auto trains on-demand; spot goes back to the one given up longest ago.
    every = {"us-east-1a": NOW - 30, "us-east-1b": NOW - 90, "us-east-1c": NOW - 60}
    assert spot_zone(three, NOW, every, ESTIMATES, prices, record) is None
    spot = zoned("spot", "us-east-1a", "us-east-1b", "us-east-1c")
    assert spot_zone(spot, NOW, every, ESTIMATES, prices, record) == 1
    # The zone is weighed against on-demand at its own price.
    dear = TrainingPrices(spot=(9.90, 25.0, 12.0), on_demand=21.96)
    assert spot_zone(three, NOW, {"us-east-1a": NOW, "us-east-1c": NOW}, ESTIMATES, dear, record) is None


def test_a_job_that_waited_too_long_moves_to_the_next_zone_and_spot_waits_in_the_last() -> None:
    """Both capacities move while another zone is open, whatever the rollout does; then auto gives
    the last one up and trains on-demand, and spot waits on there."""
    for capacity in ("auto", "spot"):
        two = zoned(capacity, "us-east-1a", "us-east-1b")
        assert give_up_zone(two, 0, {}, NOW, rollout_stalled=True)
        assert give_up_zone(two, 1, {"us-east-1a": NOW - 60}, NOW, False) == (capacity == "auto")
    two = run(spec=zoned("auto", "us-east-1a", "us-east-1b"))
    prices = TrainingPrices(spot=(9.90, 9.90), on_demand=21.96)
    observed = dataclasses.replace(seen(samples=8), training_prices=prices)
    assert LaunchTraining("r", 1, spot=True, zone=0) in plan(two, observed)
    in_b = dataclasses.replace(WAITING_T1, labels={**WAITING_T1.labels, OPTION_LABEL: "1"})
    actions = plan(dataclasses.replace(two, spot_training_refusals={"us-east-1a": NOW - 60}), seen([in_b], samples=8))
    assert StopPod(in_b.name) in actions
    assert RefuseSpotTraining("r", {"us-east-1a": NOW - 60, "us-east-1b": NOW}) in actions
    moved = dataclasses.replace(two, spot_training_refusals={"us-east-1a": NOW - 60})
    assert LaunchTraining("r", 1, spot=True, zone=1) in plan(moved, observed)


def test_a_spot_job_launches_on_spot_and_its_standby_with_it() -> None:
    observed = dataclasses.replace(seen(samples=8), training_prices=PRICES)
    assert LaunchTraining("r", 1, spot=True) in plan(run(spec=spec("spot")), observed)
    assert LaunchTraining("r", 1, spot=False) in plan(run(spec=spec("on-demand")), observed)
    warm = spec("spot").model_copy(update={"cost_policy": "always-on"})
    assert LaunchStandby("r", 0, spot=True) in plan(run(spec=warm), dataclasses.replace(seen(), training_prices=PRICES))


def test_a_preempted_job_is_started_again_without_a_failure_counted() -> None:
    preempted = dataclasses.replace(SPOT_T1, phase=PodPhase.FAILED, exit_code=-9, ended_at=NOW - 1, preempted=True)
    assert spot_loss(preempted)
    actions = plan(run(spec=spec("spot")), seen([preempted], samples=8))
    assert ReapPod(preempted) in actions
    assert not any(isinstance(a, RecordTrainingFailure) for a in actions)
    # Next tick: the same iteration again, at once (no backoff), from its checkpoint.
    assert LaunchTraining("r", 1, spot=True) in plan(run(spec=spec("spot")), seen(samples=8))
    # A job that failed by its own fault still counts.
    failed = dataclasses.replace(preempted, preempted=False, exit_code=1)
    assert not spot_loss(failed)
    assert any(isinstance(a, RecordTrainingFailure) for a in plan(run(spec=spec("spot")), seen([failed], samples=8)))


def test_auto_stops_a_job_no_spot_node_came_for_and_trains_on_demand() -> None:
    auto = run(spec=spec("auto"))
    observed = dataclasses.replace(seen([WAITING_T1], samples=8), training_prices=PRICES)
    actions = plan(auto, observed)
    assert StopPod(WAITING_T1.name) in actions
    assert RefuseSpotTraining("r", {ANY_ZONE: NOW}) in actions
    # Its end counts no failure; the next job goes on-demand while the refusal lasts.
    stopped = dataclasses.replace(WAITING_T1, phase=PodPhase.FAILED, exit_code=-15, ended_at=NOW)
    assert spot_loss(stopped)
    assert not any(isinstance(a, RecordTrainingFailure) for a in plan(auto, seen([stopped], samples=8)))
    refused = dataclasses.replace(auto, spot_training_refusals={ANY_ZONE: NOW})
    observed = dataclasses.replace(seen(samples=8), training_prices=PRICES)
    assert LaunchTraining("r", 1, spot=False) in plan(refused, observed)
    assert LaunchTraining("r", 1, spot=True) in plan(auto, observed)


def test_a_spot_pod_waiting_for_a_node_is_one_of_plans_pods() -> None:
    """A spot rollout worker waits the same way: the rule looks at training pods only."""
    worker = dataclasses.replace(pod("r-rollout-0", "rollout", slot="0"), waiting_for_node=True, started_at=0.0)
    observed = dataclasses.replace(seen([worker], prompts=2), training_prices=PRICES)
    assert not any(isinstance(a, RefuseSpotTraining) for a in plan(run(spec=spec("auto")), observed))
