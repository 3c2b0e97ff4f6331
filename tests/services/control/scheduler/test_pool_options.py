"""Where spot rollout workers go among a pool's options (services.control.scheduler.pool_options),
what plan and the loop launch from it, and what several zones do to a run in the simulator."""

from __future__ import annotations

import dataclasses

import pytest

from services.control.cost.billing import NODE_BOOT_SECONDS
from services.control.scheduler.plan import LaunchWorker, StopPod, plan
from services.control.scheduler.pool_options import Placement, option_of, place_spot, worker_prices
from services.control.simulate.workload import Workload
from services.control.simulate.world import simulate
from services.core.config import Settings
from services.domain.runspec import CostPolicy, RunSpec
from services.ports.launcher.launcher import PodStatus
from services.ports.prices.catalog import load_catalog
from services.ports.wiring import Backends
from tests.services.control.scheduler.test_plan import NOW, SPEC, pod, run, seen
from tests.services.control.simulate.trace_shapes import FOUR_NODES, LATE_SPOT, NO_SPOT, ONE_NODE_OUTAGE

PATIENCE = 180.0


def worker(slot: int, option: int, waiting: bool = False, waited: float = 0.0) -> PodStatus:
    w = pod(f"r-rollout-{slot}", "rollout", slot=str(slot), option=str(option))
    return dataclasses.replace(w, waiting_for_node=waiting, started_at=NOW - waited)


def test_one_option_works_as_a_pool_always_has() -> None:
    prices = (0.8,)
    assert place_spot(prices, [], 3, NOW, PATIENCE) == Placement(3, 0, [])
    waiting = [worker(0, 0, waiting=True), worker(1, 0, waiting=True)]
    # Waiting workers count in the pool: one more launched for a pool of 3, none stopped.
    assert place_spot(prices, waiting, 3, NOW, PATIENCE) == Placement(1, 0, [])
    # A smaller pool stops waiting workers first; a pool on nodes stops the rest.
    held = [worker(2, 0), worker(3, 0)]
    assert place_spot(prices, held + waiting, 1, NOW, PATIENCE) == Placement(0, 0, [held[1], *waiting])


def test_new_workers_go_to_the_cheapest_option_with_no_worker_waiting() -> None:
    prices = (0.9, 0.5, 0.7)
    assert place_spot(prices, [], 2, NOW, PATIENCE) == Placement(2, 1, [])
    # Option 1 has no capacity (a worker waits there): the next cheapest.
    young = worker(0, 1, waiting=True, waited=NODE_BOOT_SECONDS + 10)
    assert place_spot(prices, [young], 2, NOW, PATIENCE) == Placement(1, 2, [])
    # A probe that has waited past the patience no longer counts: replaced elsewhere, kept as a probe.
    old = worker(0, 1, waiting=True, waited=PATIENCE + 1)
    assert place_spot(prices, [old], 2, NOW, PATIENCE) == Placement(2, 2, [])


def test_each_option_keeps_one_probe_and_no_launch_once_every_option_waits() -> None:
    prices = (0.9, 0.5)
    held = [worker(5, 0)]
    a1, a2 = worker(1, 1, waiting=True, waited=500), worker(2, 1, waiting=True, waited=400)
    # Option 0 is free of waiting workers: option 1 keeps its oldest as a probe, the other goes.
    assert place_spot(prices, [*held, a1, a2], 3, NOW, PATIENCE) == Placement(2, 0, [a2])
    # Every option has one waiting: nothing launched beyond what the pool lacks, and the waiting
    # ones kept (one per option, though the pool lacks one), so no option frees for a launch.
    b = worker(3, 0, waiting=True, waited=NODE_BOOT_SECONDS + 10)
    assert place_spot(prices, [*held, worker(4, 0), a1, b], 3, NOW, PATIENCE) == Placement(0, 1, [])
    # The pool full on nodes: every waiting worker goes, then the dearest option's newest.
    full = [worker(6, 1), worker(7, 0), worker(8, 1)]
    assert place_spot(prices, [*full, a1, b], 2, NOW, PATIENCE) == Placement(0, 1, [full[1], a1, b])


def test_workers_on_their_way_to_a_node_are_counted_as_on_one() -> None:
    """On Kubernetes a new pod waits until its node joins, a minute or so: launched on the cheapest
    option, a pool's new workers stay there through the ticks of their nodes' boot, none stopped."""
    prices, pool, launched, stopped = (1.0, 1.1, 1.2), [], 0, []
    for tick in range(0, int(NODE_BOOT_SECONDS), 5):
        now = NOW + tick
        placed = place_spot(prices, pool, 4, now, PATIENCE)
        new = [worker(launched + i, placed.option) for i in range(placed.launch)]
        pool += [dataclasses.replace(w, waiting_for_node=True, started_at=now) for w in new]
        launched += placed.launch
        stopped += placed.stop
        pool = [w for w in pool if w not in placed.stop]
    assert (launched, stopped) == (4, [])
    assert {option_of(w) for w in pool} == {0}
    # Past the boot with no node, they say option 0 has no capacity: its oldest stays as its probe
    # (counted in the pool until its patience runs out), the others are replaced on option 1.
    placed = place_spot(prices, pool, 4, NOW + NODE_BOOT_SECONDS, PATIENCE)
    assert placed == Placement(3, 1, pool[1:])


SPEC_ZONES = RunSpec.model_validate(
    {
        **SPEC.model_dump(mode="json"),
        "rollout": {
            **SPEC.rollout.model_dump(mode="json"),
            "options": [{"instance_type": "g6.xlarge", "zone": "us-east-1b"}, {"instance_type": "g5.xlarge"}],
        },
    }
)


def test_plan_launches_on_the_option_and_the_loop_prices_each_option(
    scripted_backends: Backends, settings: Settings, submit
) -> None:
    from services.control.scheduler.loop import Scheduler

    observed = dataclasses.replace(seen(prompts=2), option_prices=(0.8, 0.6, 1.0))
    assert plan(run(spec=SPEC_ZONES), observed) == [LaunchWorker("r", 0, option=1)]
    # The real loop, on the embedded stores: the worker's pod asks for option 1's zone and type.
    b = scripted_backends
    run_id = submit(b, SPEC_ZONES)
    scheduler = Scheduler(b, settings)
    observed = scheduler.observe(b.state.get_run(run_id), [], SPEC_ZONES)
    catalog = scheduler.catalog
    assert observed.option_prices == (
        catalog.get("g6.xlarge").spot,
        catalog.get("g6.xlarge").spot,
        catalog.get("g5.xlarge").spot,
    )
    scheduler.tick()  # started
    scheduler.tick()
    (worker_pod,) = b.launcher.running(run_id, "rollout")
    assert worker_pod.labels["option"] in {"0", "1"}  # g6.xlarge, in any zone or in us-east-1b: one price
    assert worker_pod.instance_type == "g6.xlarge"
    (entry,) = b.state.ledger(run_id)
    assert entry.price_per_hour == catalog.get("g6.xlarge").spot


def test_plan_replaces_a_worker_waiting_past_its_patience_on_another_option() -> None:
    waiting = worker(0, 1, waiting=True, waited=PATIENCE + 100)
    observed = dataclasses.replace(seen([waiting], prompts=2), option_prices=(0.8, 0.6, 1.0))
    actions = plan(run(spec=SPEC_ZONES, worker_slots_used=1), observed)
    assert LaunchWorker("r", 1, option=0) in actions
    assert not any(isinstance(a, StopPod) for a in actions)  # kept: it takes option 1's capacity when it comes


def test_a_run_over_several_zones_ends_where_one_zone_alone_lags_or_never_ends() -> None:
    for zone in (ONE_NODE_OUTAGE, LATE_SPOT, NO_SPOT):
        alone = simulate(zone, CostPolicy.COST_AWARE, Workload())
        spread = simulate([zone, FOUR_NODES], CostPolicy.COST_AWARE, Workload())
        assert spread.finished and spread.samples_trained == Workload().batch_samples * Workload().iterations
        if alone.finished:
            assert spread.wall_seconds < 0.5 * alone.wall_seconds
            assert spread.dollars <= 1.01 * alone.dollars  # about the same bill, in a fraction of the time
        assert spread.dollars >= spread.lower_bound_dollars


def test_options_are_compared_by_the_price_of_a_worker_not_of_a_node() -> None:
    # 4 x A10 at 4 workers (or 2) a node against one A10 a node: each worker pays its GPUs' share.
    catalog = load_catalog()
    four, one = catalog.get("ecs.gn7i-4x.8xlarge"), catalog.get("ecs.gn7i-c8g1.2xlarge")
    for gpus_per_worker, options in ((1, [{"instance_type": one.instance_type}]), (2, [])):
        spec = RunSpec.model_validate(
            SPEC.model_dump(mode="json")
            | {
                "rollout": {
                    "instance_type": four.instance_type,
                    "gpus_per_worker": gpus_per_worker,
                    "options": options,
                },
                "training": {"instance_type": "ecs.gn7e-c16g1.32xlarge"},
            }
        )
        expected = [four.spot * gpus_per_worker / 4] + [one.spot for _ in options]
        assert worker_prices(spec, catalog) == pytest.approx(expected)
