"""The workload a simulated run has (``services.control.simulate.world``): its batches, its pods' rates
and start-ups, its instance types. Apart from the simulator, so that ``spotrl simulate`` declares
its options from these fields without loading the simulator (and the state store's SQLAlchemy)
before a command runs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.domain.runspec import CostPolicy, RunSpec


def _option(default: object, help: str) -> Any:
    """A workload field that ``spotrl simulate`` and ``bench/cost_policies.py`` take as an option, with its help."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Workload:
    """The seed's workload by default (the one bench/cost_policies.py measures). The fields with a
    help text are the command-line options of ``spotrl simulate`` and of the bench
    (``services.control.simulate.command.workload_options``), these defaults theirs."""

    batch_samples: int = _option(5000, "Samples per training batch.")
    samples_per_prompt: int = 4
    iterations: int = _option(12, "Training iterations of the run.")
    workers: int = _option(4, "Spot rollout workers the threshold rule holds for one batch.")
    max_workers: int = _option(16, "Most rollout workers a policy may hold.")
    worker_samples_per_hour: float = _option(3000.0, "Samples per hour of one rollout worker.")
    training_minutes: float = _option(18.0, "Minutes of training per batch on the training job's nodes.")
    training_nodes: int = _option(
        1, "Nodes of the training instance type one update runs on (training.nodes), each billed and started together."
    )
    startup_seconds: float = _option(90.0, "Node start plus model load per launch, seconds.")
    spot_notice_seconds: float = _option(120.0, "Seconds of notice before a spot preemption (AWS 120, GCP 30).")
    staleness_bound: int = _option(1, "Policy versions a sample may lag before it is dropped.")
    deadline_hours: float | None = _option(
        None, "Deadline of the run, hours (cost-aware may then use on-demand rollout)."
    )
    rollout_instance_type: str = _option("g6.xlarge", "Catalog instance type of the rollout workers.")
    gpus_per_worker: int = _option(
        1, "GPUs of each rollout worker (rollout.gpus_per_worker): a node holds its GPUs / this many workers."
    )
    training_instance_type: str = _option("p4d.24xlarge", "Catalog instance type of the training job.")
    training_capacity: str = _option(
        "on-demand",
        "Capacity of the training job: on-demand, spot or auto (spot on the training trace, checkpointed; "
        "see training.capacity).",
    )
    tick_seconds: float = 10.0
    horizon_days: float = 7.0  # a run still going then stops there, unfinished (a trace without spot capacity)

    @property
    def deadline_seconds(self) -> float | None:
        return None if self.deadline_hours is None else self.deadline_hours * 3600.0

    def spec(self, policy: CostPolicy, zones: Sequence[str] = (), training_zones: Sequence[str] = ()) -> RunSpec:
        """The run spec of this workload under ``policy``; ``zones``: more rollout options, the
        rollout instance type in each of these zones; ``training_zones``: its spot training zones."""
        prompts_per_batch = math.ceil(self.batch_samples / self.samples_per_prompt / self.workers)
        return RunSpec.model_validate(
            {
                "model": "tiny",
                "prompts": [{"prompt": "simulated"}],
                "samples_per_prompt": self.samples_per_prompt,
                "batch_samples": self.batch_samples,
                "iterations": self.iterations,
                "staleness_bound": self.staleness_bound,
                "cost_policy": policy,
                "deadline_seconds": self.deadline_seconds,
                "rollout": {
                    "instance_type": self.rollout_instance_type,
                    "gpus_per_worker": self.gpus_per_worker,
                    "min_workers": 0,
                    "max_workers": max(self.max_workers, self.workers),
                    "prompts_per_batch": prompts_per_batch,
                    "options": [{"instance_type": self.rollout_instance_type, "zone": zone} for zone in zones],
                },
                "training": {
                    "instance_type": self.training_instance_type,
                    "capacity": self.training_capacity,
                    "nodes": self.training_nodes,
                    "spot_zones": list(training_zones),
                },
            }
        )
