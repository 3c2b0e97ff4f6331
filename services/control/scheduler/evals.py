"""Held-out evaluation in the scheduler's plan (the spec's ``eval``): pure, like ``plan`` itself.

The base model (v0, the baseline) and every ``every_iterations``-th policy version are each
evaluated by an eval pod (``<run>-eval-<N>``, role ``eval``) on the rollout pool's instance type
and capacity, launched the tick after the version is recorded, beside rollout and training: never
counted as a rollout worker, never waited for by training. Each eval is opened in the state store
as its first pod launches (``LaunchEval``), so a restarted scheduler launches none twice. A pod
whose result is written is recorded (``RecordEval``), however it ended; one that ended without it
is a failure (a preempted spot pod too), retried after ``retry_delay`` up to ``EVAL_MAX_RETRIES``
times, then given up (``RecordEvalFailure``; its reason stays on the run's ``last_error``): the
run goes on.

At the run's end (``evals_at_end``): a run that ends SUCCEEDED (its iterations, a target reward,
or an eval's mean score reaching ``eval.target_score``) evaluates its last version too and waits
for its evals on a node; one still waiting for capacity is stopped and given up, so a run never
waits for capacity to end. A cancelled or failed run stops its eval pods like its other pods.

Example (every_iterations 2, iterations 5): v0 is evaluated from the first tick; v2 and v4 the
tick after each is recorded; v5, the last, as the run begins ENDING; the run is SUCCEEDED once
the evals of v4 and v5 are recorded (or given up).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from contracts.status import RunStatus
from services.control.scheduler.run_state import Observed, RunState, retry_delay
from services.domain.names import ROLE_EVAL
from services.ports.launcher.launcher import PodStatus

# Failed eval pods of one version retried before its eval is given up (the run goes on without it).
EVAL_MAX_RETRIES = 2


@dataclass(frozen=True)
class LaunchEval:
    """Evaluate policy ``version`` on the held-out prompts (an eval pod, the rollout pool's kind)."""

    run_id: str
    version: int


@dataclass(frozen=True)
class RecordEval:
    """Store the result the eval pod of ``version`` wrote."""

    run_id: str
    version: int


@dataclass(frozen=True)
class RecordEvalFailure:
    """Count a failed eval pod of ``version``: retried from ``retry_at``, or never again with ``gave_up`` (the reason)."""

    run_id: str
    version: int
    failures: int
    retry_at: float
    gave_up: str | None = None


EvalAction = LaunchEval | RecordEval | RecordEvalFailure


def evals_due(run: RunState, observed: Observed, *, final: bool) -> list[LaunchEval]:
    """The evals to launch now: each chosen version recorded since the last launched (v0 first),
    and each open eval without a pod whose retry time has come. Chosen: v0 and every
    ``every_iterations``-th version; with ``final`` (the run succeeded) its last version too."""
    spec = run.spec.eval
    if spec is None:
        return []
    running = {int(p.labels["version"]) for p in observed.pods if p.role == ROLE_EVAL}
    due = [v for v, e in run.evals_open.items() if v not in running and observed.now >= e.retry_at]
    due += [
        v
        for v in range(run.eval_launched_through + 1, run.iterations_done + 1)
        if v % spec.every_iterations == 0 or (final and v == run.iterations_done)
    ]
    return [LaunchEval(run.run_id, v) for v in sorted(due)]


def reap_eval(run: RunState, pod: PodStatus, observed: Observed) -> list[EvalAction]:
    """An ended eval pod: its result recorded if written; else a failure counted, unless the run
    stopped it (cancelled or failing) or its eval is given up already."""

    version = int(pod.labels["version"])
    if version in observed.evals_published:
        return [RecordEval(run.run_id, version)]
    state = run.evals_open.get(version)
    if state is None or (run.status.is_stopping() and run.ending_status != RunStatus.SUCCEEDED):
        return []
    failures = state.failures + 1
    if failures > EVAL_MAX_RETRIES:
        reason = (
            f"eval of policy v{version} failed {failures} times (last exit code {pod.exit_code}), given up; "
            f"see `spotrl logs {pod.name}`"
        )
        return [RecordEvalFailure(run.run_id, version, failures, observed.now, gave_up=reason)]
    return [RecordEvalFailure(run.run_id, version, failures, observed.now + retry_delay(failures))]


def evals_at_end(
    run: RunState, observed: Observed, alive: Sequence[PodStatus], *, succeeded: bool
) -> tuple[list[PodStatus], list[EvalAction]]:
    """The eval pods the run's end waits for, and what it does about its evals now: those still
    waiting for a node given up (``plan`` stops them), and the launches due, the last version's
    included. Only a run that succeeded and has evals waits; any other end waits for none."""
    if not succeeded or run.spec.eval is None:
        return [], []
    kept = [p for p in alive if p.role == ROLE_EVAL and not p.waiting_for_node]
    unplaced = sorted(int(p.labels["version"]) for p in alive if p.role == ROLE_EVAL and p.waiting_for_node)
    actions: list[EvalAction] = [
        RecordEvalFailure(
            run.run_id,
            v,
            run.evals_open[v].failures,
            observed.now,
            gave_up=f"the run ended while the eval pod of policy v{v} waited for a node",
        )
        for v in unplaced
        if v in run.evals_open
    ]
    return kept, [*actions, *evals_due(run, observed, final=True)]
