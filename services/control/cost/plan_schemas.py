"""A plan's request and response, as ``POST /v1/plan`` and ``spotrl plan FILE`` read and write
them, and the step between: prices from the catalog unless given directly, in one currency."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from contracts.tensor_parallel import MAX_TENSOR_PARALLEL
from services.control.cost.planner import (
    SECONDS_PER_HOUR,
    AlwaysOn,
    Overheads,
    Plan,
    PlanError,
    RolloutOption,
    TrainingOption,
    Workload,
    plan_run,
)
from services.ports.prices.catalog import InstancePrice, PriceCatalog, UnknownInstanceTypeError

STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)
MAX_OPTIONS = 32
Name = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:+-]*$")]
Price = Annotated[float, Field(gt=0, le=1e6, description="Per instance-hour, in the plan's currency.")]
Seconds = Annotated[float, Field(ge=0, le=86400)]
Gpus = Annotated[int, Field(ge=1, le=64, description="GPUs per instance.")]


class _Instance(BaseModel):
    model_config = STRICT
    instance_type: Name = Field(description="A price catalog instance type, or any name when price_per_hour is given.")
    gpu: Name | None = Field(default=None, description="GPU type (L20, A100-80GB); default the catalog's.")
    gpus: Gpus | None = Field(default=None, description="GPUs per instance; default the catalog's.")
    price_per_hour: Price | None = Field(default=None, description="Overrides the catalog price.")


class RolloutOptionIn(_Instance):
    samples_per_second_per_gpu: float | None = Field(
        default=None,
        gt=0,
        le=1e6,
        description="Rollout throughput of one GPU of a worker: a worker's, divided by its gpus_per_worker.",
    )
    samples_per_hour_per_gpu: float | None = Field(
        default=None, gt=0, le=1e9, description="The same, per hour (give one of the two)."
    )
    capacity_type: Literal["spot", "on-demand"] = "spot"
    gpus_per_worker: int = Field(
        default=1,
        ge=1,
        le=MAX_TENSOR_PARALLEL,
        description="GPUs one rollout worker uses (the run's rollout.gpus_per_worker); a divisor of the instance's GPUs. "
        "The model must fit a worker's GPUs, and a worker makes samples_per_*_per_gpu times its GPUs.",
    )
    on_demand_price_per_hour: Price | None = Field(
        default=None, description="For the default always-on comparison; default the catalog's on-demand price."
    )
    max_instances: int = Field(default=16, ge=1, le=1024, description="The most instances the pool may have.")

    @model_validator(mode="after")
    def _one_rate(self) -> RolloutOptionIn:
        if (self.samples_per_second_per_gpu is None) == (self.samples_per_hour_per_gpu is None):
            raise ValueError("give exactly one of samples_per_second_per_gpu and samples_per_hour_per_gpu")
        return self


class TrainingOptionIn(_Instance):
    seconds_per_batch: float | None = Field(
        default=None,
        gt=0,
        le=7 * 86400,
        description="Training seconds per update; default derived from model_params, tokens_per_sample and the GPUs (see the planner).",
    )
    nodes: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Instances one update runs on (a run's training.nodes): their GPUs hold and train the model "
        "together, and each is paid.",
    )


class OverheadsIn(BaseModel):
    model_config = STRICT
    node_start_seconds: Seconds = 0.0
    image_pull_seconds: Seconds = 0.0
    model_load_seconds: Seconds = 0.0


class AlwaysOnIn(_Instance):
    """The always-on cluster to compare with (e.g. one 8-GPU node doing rollout and training)."""


class PlanRequest(BaseModel):
    """What to plan: the workload, the rollout and training options, start-up overheads, prices."""

    model_config = STRICT
    model_params: float = Field(ge=1e6, le=1e13, description="Parameters of the policy model.")
    samples_per_update: int = Field(
        ge=1, le=100_000_000, description="Samples per training update (the run's batch_samples)."
    )
    tokens_per_sample: int = Field(
        default=1024, ge=1, le=1_000_000, description="Prompt and response tokens of a sample."
    )
    training_mfu: float = Field(
        default=0.35, gt=0, le=1, description="Model FLOPS utilisation, for derived training seconds."
    )
    rollout: list[RolloutOptionIn] = Field(min_length=1, max_length=MAX_OPTIONS)
    training: list[TrainingOptionIn] = Field(min_length=1, max_length=MAX_OPTIONS)
    overheads: OverheadsIn = Field(default_factory=OverheadsIn, description="Start-up of a training launch.")
    always_on: AlwaysOnIn | None = Field(default=None, description="Default: the plan's shapes held on-demand.")
    currency: str | None = Field(
        default=None,
        pattern=r"^[A-Z]{3}$",
        description="ISO 4217 code; default the catalog's. Needed when every price is given directly.",
    )


class TermPublic(BaseModel):
    name: str
    arithmetic: str = Field(description="How the amount is reached, each factor named.")
    amount: float


class PoolPublic(BaseModel):
    instance_type: str
    gpu: str
    gpus_per_instance: int
    gpus_per_worker: int
    workers_per_instance: int
    instances: int
    capacity_type: str
    price_per_hour: float = Field(description="One instance.")


class TrainingShapePublic(BaseModel):
    instance_type: str
    gpu: str
    gpus: int = Field(description="Per instance.")
    nodes: int = Field(description="Instances the update runs on, each paid price_per_hour.")
    price_per_hour: float = Field(description="One instance, on-demand.")
    seconds_per_batch: float
    seconds_per_batch_derived: bool = Field(description="True when derived from the model size, not given.")
    keep_warm: bool = Field(description="Kept up between updates (the idle gap costs less than a restart).")


class PlanPublic(BaseModel):
    currency: str
    rollout: PoolPublic
    training: TrainingShapePublic
    update_seconds: float = Field(description="Seconds between updates in steady state.")
    rollout_seconds: float
    training_billed_seconds: float = Field(
        description="Training seconds paid per update (start-up or warm idle included)."
    )
    cost_per_update: float
    cost_per_day: float
    updates_per_day: float
    always_on_instance: str
    always_on_per_update: float
    always_on_per_day: float
    saving: float = Field(description="1 - cost / always-on: 0.88 is 88% less.")
    terms: list[TermPublic]
    notes: list[str] = Field(description="Options left out, and checks not made.")


def plan_request(request: PlanRequest, catalog: PriceCatalog) -> Plan:
    """The plan for ``request``, priced from ``catalog`` where the request gives no price."""
    currencies: set[str] = set()
    rollout = [_rollout(i, o, catalog, currencies) for i, o in enumerate(request.rollout)]
    training = [_training(i, o, catalog, currencies) for i, o in enumerate(request.training)]
    always_on = None
    if request.always_on is not None:
        _, price = _priced(("always_on",), request.always_on, catalog, currencies)
        always_on = AlwaysOn(request.always_on.instance_type, price)
    currency = _one_currency(request.currency, currencies)
    workload = Workload(
        request.model_params, request.samples_per_update, request.tokens_per_sample, request.training_mfu
    )
    o = request.overheads
    return plan_run(
        workload,
        rollout,
        training,
        currency=currency,
        always_on=always_on,
        overheads=Overheads(o.node_start_seconds, o.image_pull_seconds, o.model_load_seconds),
    )


def plan_public(plan: Plan) -> PlanPublic:
    r, t = plan.rollout, plan.training
    return PlanPublic(
        currency=plan.currency,
        rollout=PoolPublic(
            instance_type=r.instance_type,
            gpu=r.gpu,
            gpus_per_instance=r.gpus,
            gpus_per_worker=r.gpus_per_worker,
            workers_per_instance=r.workers_per_instance,
            instances=plan.rollout_instances,
            capacity_type=r.capacity_type,
            price_per_hour=r.price_per_hour,
        ),
        training=TrainingShapePublic(
            instance_type=t.instance_type,
            gpu=t.gpu,
            gpus=t.gpus,
            nodes=t.nodes,
            price_per_hour=t.price_per_hour,
            seconds_per_batch=plan.training_seconds_per_batch,
            seconds_per_batch_derived=plan.training_seconds_derived,
            keep_warm=plan.keep_training_warm,
        ),
        update_seconds=plan.update_seconds,
        rollout_seconds=plan.rollout_seconds,
        training_billed_seconds=plan.training_billed_seconds,
        cost_per_update=plan.cost_per_update,
        cost_per_day=plan.cost_per_day,
        updates_per_day=plan.updates_per_day,
        always_on_instance=plan.always_on.instance_type,
        always_on_per_update=plan.always_on_per_update,
        always_on_per_day=plan.always_on_per_day,
        saving=plan.saving,
        terms=[TermPublic(name=x.name, arithmetic=x.arithmetic, amount=x.amount) for x in plan.terms],
        notes=list(plan.notes),
    )


def _priced(
    loc: tuple[str | int, ...],
    o: _Instance,
    catalog: PriceCatalog,
    currencies: set[str],
    capacity_type: str = "on-demand",
) -> tuple[InstancePrice | None, float]:
    """The catalog entry of ``o`` (None when it is priced directly) and its price per hour."""
    try:
        entry = catalog.get(o.instance_type)
    except UnknownInstanceTypeError:
        if o.price_per_hour is None or o.gpu is None or o.gpus is None:
            raise PlanError(
                (*loc, "instance_type"),
                "not in the price catalog: give price_per_hour, gpu and gpus to price it directly, or use a catalog instance type",
            ) from None
        return None, o.price_per_hour
    if o.price_per_hour is not None:
        return entry, o.price_per_hour  # a price given directly is in the plan's currency, whatever the catalog's
    currencies.add(entry.currency)
    return entry, entry.price(capacity_type)


def _rollout(i: int, o: RolloutOptionIn, catalog: PriceCatalog, currencies: set[str]) -> RolloutOption:
    entry, price = _priced(("rollout", i), o, catalog, currencies, o.capacity_type)
    on_demand = o.on_demand_price_per_hour
    if on_demand is None and entry is not None:
        currencies.add(entry.currency)
        on_demand = entry.on_demand
    per_hour = o.samples_per_hour_per_gpu or o.samples_per_second_per_gpu * SECONDS_PER_HOUR  # type: ignore[operator]
    gpus = o.gpus or entry.gpus
    if gpus % o.gpus_per_worker:
        fitting = ", ".join(str(n) for n in range(1, gpus + 1) if gpus % n == 0)
        raise PlanError(
            ("rollout", i, "gpus_per_worker"),
            f"gpus_per_worker {o.gpus_per_worker} does not divide the instance's {gpus} GPUs: give one of {fitting}",
        )
    return RolloutOption(
        instance_type=o.instance_type,
        gpu=o.gpu or entry.gpu,
        gpus=gpus,
        gpus_per_worker=o.gpus_per_worker,
        samples_per_hour_per_gpu=per_hour,
        capacity_type=o.capacity_type,
        price_per_hour=price,
        on_demand_price_per_hour=on_demand,
        max_instances=o.max_instances,
    )


def _training(i: int, o: TrainingOptionIn, catalog: PriceCatalog, currencies: set[str]) -> TrainingOption:
    entry, price = _priced(("training", i), o, catalog, currencies)
    return TrainingOption(
        instance_type=o.instance_type,
        gpu=o.gpu or entry.gpu,
        gpus=o.gpus or entry.gpus,
        price_per_hour=price,
        seconds_per_batch=o.seconds_per_batch,
        nodes=o.nodes,
    )


def _one_currency(given: str | None, catalog_currencies: set[str]) -> str:
    if len(catalog_currencies) > 1:
        raise PlanError(
            ("currency",),
            f"the catalog prices these options in {', '.join(sorted(catalog_currencies))}: "
            "give every price in one currency (price_per_hour) or choose instances priced in one",
        )
    if given is not None and catalog_currencies and given not in catalog_currencies:
        raise PlanError(
            ("currency",),
            f"the catalog prices these options in {next(iter(catalog_currencies))}: give that currency, or every price directly",
        )
    if given is None and not catalog_currencies:
        raise PlanError(("currency",), "every price is given directly: say their currency")
    return given or next(iter(catalog_currencies))
