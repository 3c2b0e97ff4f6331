"""What ``plan`` reads: a run's state as the state store holds it (``RunState``, with its open
evals' ``EvalState``), the world as observed this tick (``Observed``), the pods' roles, and the
backoff after a failed training job. The plan's parts (``plan``, ``evals``, ``ledger_match``,
``reward_server``) all read these; none of them is imported here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields

from contracts.status import RunStatus
from services.control.scheduler.policies import Estimates
from services.control.scheduler.spot_training import SpotTrainingRecord, TrainingPrices
from services.domain.names import ROLE_STANDBY, ROLE_TRAINING
from services.domain.runspec import RunSpec
from services.ports.launcher.launcher import PodStatus
from services.ports.state.state_schema import RunRow
from services.ports.state.state_store import LedgerEntry

RETRY_BASE_SECONDS = 5.0
RETRY_MAX_SECONDS = 300.0


def retry_delay(failures: int) -> float:
    """Exponential backoff after the ``failures``-th failed training job: 5 s, 10 s, 20 s ... 300 s."""
    return min(RETRY_MAX_SECONDS, RETRY_BASE_SECONDS * 2 ** max(0, failures - 1))


@dataclass(frozen=True)
class EvalState:
    """An eval launched and neither recorded nor given up: its failed pods so far, and when the next may start."""

    failures: int = 0
    retry_at: float = 0.0


@dataclass(frozen=True)
class RunState:
    """Desired and recorded state of one run, as the state store holds it; the defaults are a new run's."""

    run_id: str
    status: RunStatus
    spec: RunSpec
    iterations_done: int = 0
    last_mean_reward: float | None = None
    prompts_published: int = 0
    ending_status: RunStatus | None = None  # while CANCELLING or ENDING: the terminal status to end with
    ending_reason: str | None = None
    train_failures: int = 0
    next_train_at: float = 0.0
    worker_slots_used: int = 0
    samples_produced: int = 0
    train_launch_committed: int = 0  # trainer offsets (summed) when the running job started
    started_at: float | None = None  # when the run started (its deadline counts from there)
    eval_launched_through: int = -1  # the highest policy version an eval was launched for (-1: none yet)
    evals_open: Mapping[int, EvalState] = field(default_factory=dict)  # by policy version
    best_eval: tuple[int, float] | None = None  # (policy version, mean score) of the best recorded eval
    status_reason: str | None = None  # shown with the status; while RUNNING, the cost policy's account of its capacity
    # The spot zones where the run last gave up waiting for a training node, each with when
    # (services.control.scheduler.spot_training; "": any zone).
    spot_training_refusals: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, row: RunRow, spec: RunSpec, **evals: object) -> RunState:
        """The state of the run stored as `row` (its spec parsed as `spec`): each field named as a
        column of the row is that column, so a field added to both is carried without another line
        here; `evals` are the eval fields, which the store keeps in rows of their own."""
        converted = dict(
            run_id=row.id,
            status=RunStatus(row.status),
            spec=spec,
            ending_status=RunStatus(row.ending_status) if row.ending_status else None,
            spot_training_refusals=row.spot_training_refusals or {},
        )
        columns = RunRow.__table__.columns.keys()
        same = {f.name: getattr(row, f.name) for f in fields(cls) if f.name in columns and f.name not in converted}
        return cls(**converted, **same, **evals)


@dataclass(frozen=True)
class Observed:
    """What the world looks like now."""

    pods: Sequence[PodStatus]
    prompt_backlog: int  # prompts published and not yet committed by the rollout group
    sample_backlog: int  # samples queued and not yet committed by the trainer group
    samples_produced: int  # every sample ever queued for the run
    spent_dollars: float
    billed: frozenset[str]  # pods with a ledger entry, open or closed
    open_entries: Mapping[str, float]  # pod -> start of its open ledger entry (the pod listed or not)
    now: float
    trainer_committed: int = 0  # trainer-group committed offsets, summed over partitions
    published: frozenset[int] = frozenset()  # iterations of ended training pods whose result.json exists
    estimates: Estimates = Estimates(None, None)  # rollout rate and training time measured so far, for the policy
    evals_published: frozenset[int] = frozenset()  # policy versions of ended eval pods whose result exists
    # (time, samples spot rollout workers had made by then), oldest first, over the recent past:
    # the deadline rule's pace (services.control.scheduler.deadline); empty where nobody records it.
    spot_progress: tuple[tuple[float, int], ...] = ()
    # The training instance type's spot prices (by spot zone) and on-demand price now, and the run's
    # spot training so far: what ``training.capacity: auto`` weighs (services.control.scheduler.spot_training).
    training_prices: TrainingPrices | None = None
    # Each rollout pool option's spot price per hour now (``RolloutPool.choices``); empty: all alike.
    option_prices: tuple[float, ...] = ()
    spot_training: SpotTrainingRecord = SpotTrainingRecord()
    # When the run's last training job or standby pod ended (its node may still be up a while).
    training_ended_at: float | None = None


def training_ended_at(ledger: Iterable[LedgerEntry]) -> float | None:
    """When the last of the run's training and standby pods ended, from its ledger; None if none has."""
    ends = [e.ended_at for e in ledger if e.role in (ROLE_TRAINING, ROLE_STANDBY) and e.ended_at is not None]
    return max(ends, default=None)
