"""The run planner: which rollout pool and training shape to use, and what an update will cost,
before a run starts. Pure arithmetic: no I/O, prices already resolved (``plan_schemas``).

The run is a pipeline in steady state: the spot rollout pool generates the next batch while the
on-demand training instance trains on the last one. For one update of ``S`` samples, with a pool
of ``n`` instances of ``r`` samples/h each at ``p_r``/h, and training on ``k`` instances (nodes)
at ``p_t``/h each taking ``t`` seconds per batch, with ``o`` seconds of start-up per launch (node
start + image pull + model load; the ``k`` nodes boot at once and the job starts when all have):

    rollout seconds   R = S · 3600 / (n · r)
    update seconds    U = max(R, t)                      an update lands every U seconds
    training idle gap g = U − t
    training billed   B = t + min(g, o)                  ski rental: kept warm through a gap
                                                         shorter than a restart, else shut down
                                                         and started again (paying o)
    cost per update     = n · p_r · U / 3600  +  k · p_t · B / 3600
    cost per day        = cost per update · 86400 / U
    always-on per update = p_a · U / 3600                p_a: the always-on cluster's price per
                                                         hour, by default the same shapes held
                                                         on-demand (n · on-demand p_r + k · p_t)
    saving              = 1 − cost per update / always-on per update

The pool size ``n`` is the largest (up to the option's ``max_instances``) whose next batch is
ready no sooner than training finishes: ``n = floor(S · 3600 / (r · t))``, at least 1. A larger
pool would only wait on training, holding spot GPUs for samples the staleness bound allows no
sooner; a smaller one costs the same per update and lands fewer per day. Among all rollout and
training options that fit the model, the plan is the one cheapest per update, then fastest.

The seed's worked example: ``S`` = 12,000 samples, 4 × L20 spot at ¥10/h each producing 3,000
samples/h each (¥40/h, 12,000 samples/h), training on 2 × A100 at ¥240/h taking 18 minutes per
batch, start-up not counted (o = 0). Then R = 3600 s, U = 3600 s ("that hour's work"),
g = 2520 s ≥ o so B = t = 1080 s: ¥40 + ¥72 = ¥112, against an 8 × A100 cluster at ¥960/h held
the hour: ¥960, 88% less.

Training seconds per batch, when an option does not give them, are derived from the model size
``N`` (parameters) and the batch's tokens ``S · T``: ``8 · N · S · T`` FLOPs (6·N per token for
the update's forward and backward passes, Kaplan et al. 2020, plus 2·N for the forward pass that
scores the batch under the old policy) over ``k · gpus · peak BF16 FLOPS · MFU``: more nodes
train faster, at the same cost per update where the MFU holds.

A shape fits the model when its memory holds it: training needs 16 bytes per parameter (BF16
weights and gradients, FP32 master weights and Adam's two moments), sharded over the GPUs of the
job's nodes (ZeRO-3/FSDP) in at most 80% of their memory, the rest for activations; rollout needs the
BF16 weights (2 bytes per parameter) in at most 60% of one worker's GPUs' memory, the rest for the
KV cache. A rollout instance of G GPUs holds G / ``gpus_per_worker`` workers (the run spec's
``rollout.gpus_per_worker``), each making its GPUs' samples: a worker that needs two GPUs for its
model makes ``r`` per hour with two, so its samples cost two GPUs' price. One-off costs (the first launch, a preempted worker's restart) are not in the steady
state: the simulator (``spotrl simulate``) plays those out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import partial

from services.control.cost.gpus import gpu_figures

SECONDS_PER_HOUR = 3600.0
SECONDS_PER_DAY = 86400.0
TRAINING_BYTES_PER_PARAM = 16
TRAINING_MEMORY_SHARE = 0.8
ROLLOUT_BYTES_PER_PARAM = 2
ROLLOUT_MEMORY_SHARE = 0.6
FLOPS_PER_PARAM_PER_TOKEN = 8
# Pool sizes are whole instances; a ratio that is an integer up to rounding counts as that integer.
_WHOLE = 1e-9


class PlanError(ValueError):
    """Inputs no plan can be made from; ``loc`` names the input (``("training", 1)``)."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc


@dataclass(frozen=True)
class Workload:
    model_params: float  # parameters of the policy
    samples_per_update: int  # the run's batch_samples
    tokens_per_sample: int  # prompt and response tokens, for derived training seconds
    training_mfu: float  # model FLOPS utilisation, for derived training seconds


@dataclass(frozen=True)
class RolloutOption:
    instance_type: str
    gpu: str
    gpus: int  # per instance
    samples_per_hour_per_gpu: float  # of a worker's GPU: a worker of n GPUs makes n times this
    capacity_type: str  # "spot" or "on-demand"
    price_per_hour: float  # one instance, at capacity_type
    on_demand_price_per_hour: float | None  # one instance, for the default always-on cluster
    max_instances: int
    gpus_per_worker: int = 1  # a divisor of ``gpus``: an instance holds gpus / gpus_per_worker workers

    @property
    def workers_per_instance(self) -> int:
        return self.gpus // self.gpus_per_worker

    @property
    def samples_per_hour(self) -> float:
        """One instance's: each of its workers makes its GPUs' samples."""
        return self.samples_per_hour_per_gpu * self.gpus_per_worker * self.workers_per_instance


@dataclass(frozen=True)
class TrainingOption:
    instance_type: str
    gpu: str
    gpus: int  # per instance
    price_per_hour: float  # on-demand, one instance
    seconds_per_batch: float | None  # None: derived from the model size and the GPUs
    nodes: int = 1  # instances one update runs on, each paid

    @property
    def all_gpus(self) -> int:
        return self.gpus * self.nodes

    @property
    def nodes_price_per_hour(self) -> float:
        return self.price_per_hour * self.nodes


@dataclass(frozen=True)
class Overheads:
    node_start_seconds: float = 0.0
    image_pull_seconds: float = 0.0
    model_load_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return self.node_start_seconds + self.image_pull_seconds + self.model_load_seconds


@dataclass(frozen=True)
class AlwaysOn:
    """The cluster the plan is compared with, held for the whole update."""

    instance_type: str
    price_per_hour: float


@dataclass(frozen=True)
class Term:
    """One line of the bill: what it is, its arithmetic in words and figures, and the amount."""

    name: str
    arithmetic: str
    amount: float


@dataclass(frozen=True)
class Shape:
    """A rollout pool and a training shape, with their steady-state seconds and costs per update."""

    rollout: RolloutOption
    rollout_instances: int
    training: TrainingOption
    training_seconds_per_batch: float
    training_seconds_derived: bool
    keep_training_warm: bool
    rollout_seconds: float
    update_seconds: float
    training_billed_seconds: float
    rollout_cost: float
    training_cost: float

    @property
    def cost_per_update(self) -> float:
        return self.rollout_cost + self.training_cost

    @property
    def updates_per_day(self) -> float:
        return SECONDS_PER_DAY / self.update_seconds

    @property
    def cost_per_day(self) -> float:
        return self.cost_per_update * self.updates_per_day


@dataclass(frozen=True)
class Plan(Shape):
    """The shape recommended, against always-on, with the arithmetic of each term."""

    currency: str
    always_on: AlwaysOn
    always_on_per_update: float
    terms: tuple[Term, ...]
    notes: tuple[str, ...]

    @property
    def always_on_per_day(self) -> float:
        return self.always_on_per_update * self.updates_per_day

    @property
    def saving(self) -> float:
        """The share of the always-on bill the plan does not pay (0.88 = 88% less)."""
        return 1 - self.cost_per_update / self.always_on_per_update


def plan_run(
    workload: Workload,
    rollout: Sequence[RolloutOption],
    training: Sequence[TrainingOption],
    *,
    overheads: Overheads,
    currency: str,
    always_on: AlwaysOn | None = None,
) -> Plan:
    """The cheapest plan per update (then the fastest) over every rollout and training option
    that fits the model; ``always_on`` None compares with the same shapes held on-demand."""
    notes: list[str] = []
    rollout_fit = [
        (i, o) for i, o in enumerate(rollout) if _fits("rollout", i, o.gpu, o.gpus_per_worker, workload, notes)
    ]
    training_fit = [(i, o) for i, o in enumerate(training) if _fits("training", i, o.gpu, o.all_gpus, workload, notes)]
    if not rollout_fit:
        raise PlanError(
            ("rollout",),
            "no rollout option holds the model's weights in a worker's GPUs: raise an option's gpus_per_worker, "
            "or add one with more memory per GPU",
        )
    if not training_fit:
        raise PlanError(
            ("training",), "no training option holds the model for training: add one with more GPUs or GPU memory"
        )
    seconds = {i: _training_seconds(i, o, workload) for i, o in training_fit}
    shapes = [_shape(workload, r, t, seconds[j], overheads) for _, r in rollout_fit for j, t in training_fit]
    best = min(shapes, key=lambda s: (s.cost_per_update, s.update_seconds))
    if always_on is None:
        r = best.rollout
        if r.on_demand_price_per_hour is None:
            index = next(i for i, o in rollout_fit if o is r)
            raise PlanError(
                ("rollout", index, "on_demand_price_per_hour"),
                "the chosen rollout option has no on-demand price for the always-on comparison: give it, or give always_on",
            )
        always_on = AlwaysOn(
            f"{best.rollout_instances} x {r.instance_type} + {_nodes(best.training)}, on-demand",
            best.rollout_instances * r.on_demand_price_per_hour + best.training.nodes_price_per_hour,
        )
    return _plan(best, workload, overheads, always_on, currency, tuple(notes))


def _shape(workload: Workload, r: RolloutOption, t: TrainingOption, train_s: float, overheads: Overheads) -> Shape:
    samples = workload.samples_per_update
    ready_as_training_ends = math.floor(samples * SECONDS_PER_HOUR / (r.samples_per_hour * train_s) + _WHOLE)
    n = min(r.max_instances, max(1, ready_as_training_ends))
    rollout_s = samples * SECONDS_PER_HOUR / (r.samples_per_hour * n)
    update_s = max(rollout_s, train_s)
    gap = update_s - train_s
    warm = gap < overheads.seconds
    billed = train_s + min(gap, overheads.seconds)
    return Shape(
        rollout=r,
        rollout_instances=n,
        training=t,
        training_seconds_per_batch=train_s,
        training_seconds_derived=t.seconds_per_batch is None,
        keep_training_warm=warm,
        rollout_seconds=rollout_s,
        update_seconds=update_s,
        training_billed_seconds=billed,
        rollout_cost=n * r.price_per_hour * update_s / SECONDS_PER_HOUR,
        training_cost=t.nodes_price_per_hour * billed / SECONDS_PER_HOUR,
    )


def _fits(role: str, index: int, gpu: str, gpus: int, workload: Workload, notes: list[str]) -> bool:
    """Whether ``gpus`` GPUs of type ``gpu`` hold the model: a training instance's, or one rollout worker's."""
    figures = gpu_figures(gpu)
    if figures is None:
        notes.append(f"{role}[{index}]: GPU {gpu} is not in spotrl's GPU table; its memory fit was not checked")
        return True
    bytes_per_param, share = (
        (TRAINING_BYTES_PER_PARAM, TRAINING_MEMORY_SHARE)
        if role == "training"
        else (ROLLOUT_BYTES_PER_PARAM, ROLLOUT_MEMORY_SHARE)
    )
    need_gb = workload.model_params * bytes_per_param / 1e9
    have_gb = gpus * figures.memory_gb * share
    if need_gb > have_gb:
        holder = "the job's GPUs'" if role == "training" else "a worker's"
        notes.append(
            f"{role}[{index}]: {gpus} x {gpu} left out: the model needs {need_gb:,.0f} GB, "
            f"{share:.0%} of {holder} memory is {have_gb:,.0f} GB"
        )
        return False
    return True


def _training_seconds(index: int, t: TrainingOption, workload: Workload) -> float:
    if t.seconds_per_batch is not None:
        return t.seconds_per_batch
    figures = gpu_figures(t.gpu)
    if figures is None or figures.tflops is None:
        raise PlanError(
            ("training", index, "seconds_per_batch"),
            "give seconds_per_batch: spotrl knows no peak FLOPS for this GPU to derive it from (services/control/cost/gpus.py)",
        )
    flops = FLOPS_PER_PARAM_PER_TOKEN * workload.model_params * workload.samples_per_update * workload.tokens_per_sample
    return flops / (t.all_gpus * figures.tflops * 1e12 * workload.training_mfu)


def _training_seconds_note(t: TrainingOption, workload: Workload) -> str:
    if t.seconds_per_batch is not None:
        return "given"
    return (
        f"derived: {FLOPS_PER_PARAM_PER_TOKEN} x {workload.model_params:.3g} params x {workload.samples_per_update:,} samples "
        f"x {workload.tokens_per_sample:,} tokens / ({t.all_gpus} x {t.gpu} peak x {workload.training_mfu:.0%} MFU)"
    )


def workers_text(r: RolloutOption) -> str:
    """How an instance of several GPUs holds workers ("2 workers of 2 GPUs"); nothing for one GPU."""
    if r.gpus == 1:
        return ""
    workers = f"{r.workers_per_instance} worker{'s' if r.workers_per_instance > 1 else ''}"
    return f"{workers} of {r.gpus_per_worker} GPU{'s' if r.gpus_per_worker > 1 else ''}"


def _workers(r: RolloutOption) -> str:
    text = workers_text(r)
    return f"; {text}" if text else ""


def _nodes(t: TrainingOption) -> str:
    return t.instance_type if t.nodes == 1 else f"{t.nodes} x {t.instance_type}"


def _money(currency: str, amount: float) -> str:
    return f"{currency} {amount:,.2f}"


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:,.1f} min"


def _plan(
    s: Shape, workload: Workload, overheads: Overheads, always_on: AlwaysOn, currency: str, notes: tuple[str, ...]
) -> Plan:
    r, t = s.rollout, s.training
    m = partial(_money, currency)
    per_batch = f"{_minutes(s.training_seconds_per_batch)} per batch ({_training_seconds_note(t, workload)})"
    if s.keep_training_warm:
        idle = s.update_seconds - s.training_seconds_per_batch
        training_time = f"{per_batch} + {_minutes(idle)} idle, kept warm (a restart costs {_minutes(overheads.seconds)} of start-up)"
    else:
        training_time = f"{per_batch} + {_minutes(overheads.seconds)} start-up"
    terms = (
        Term(
            "rollout",
            f"{s.rollout_instances} x {r.instance_type} ({r.gpus} x {r.gpu}, {r.capacity_type}{_workers(r)}) "
            f"at {m(r.price_per_hour)}/h each "
            f"for {_minutes(s.update_seconds)} ({workload.samples_per_update:,} samples at "
            f"{s.rollout_instances * r.samples_per_hour:,.0f} samples/h take {_minutes(s.rollout_seconds)})",
            s.rollout_cost,
        ),
        Term(
            "training",
            f"{_nodes(t)} ({t.gpus} x {t.gpu}, on-demand) at {m(t.price_per_hour)}/h{' each' if t.nodes > 1 else ''} "
            f"for {_minutes(s.training_billed_seconds)}: {training_time}",
            s.training_cost,
        ),
        Term("per update", f"{m(s.rollout_cost)} + {m(s.training_cost)}", s.cost_per_update),
        Term(
            "always-on per update",
            f"{always_on.instance_type} at {m(always_on.price_per_hour)}/h for {_minutes(s.update_seconds)}",
            always_on.price_per_hour * s.update_seconds / SECONDS_PER_HOUR,
        ),
    )
    return Plan(
        **{f.name: getattr(s, f.name) for f in fields(Shape)},
        currency=currency,
        always_on=always_on,
        always_on_per_update=terms[-1].amount,
        terms=terms,
        notes=notes,
    )
