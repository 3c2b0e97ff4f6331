"""Ending everything spotrl runs when spotrl itself goes away: ``spotrl teardown``, which the Helm
chart runs as a pre-delete hook, before an uninstall deletes the scheduler.

The pods the launcher starts outlive the scheduler. On Kubernetes they carry the finalizer
``spotrl.dev/reap`` (an ended pod stays readable, exit code and all, until the scheduler reaps it)
and no owner reference, so an uninstall that deleted only the chart's objects would leave spot
GPU pods running with no deadline, and a namespace deletion hanging on their finalizer. Owner
references would not help: the garbage collector deletes a dependent as any delete does, and the
finalizer holds it all the same; something must stop the pods and take the finalizer off.

The teardown does what the scheduler does for a cancelled run, for every run at once, with a
deadline. An example with ``grace_s=30``, ``timeout_s=240``, a run R with two rollout pods and a
training Job, and the scheduler still running (the hook runs before Helm deletes it):

1. t=0    R is cancelled in the state store (CANCELLING), so the scheduler stops its pods rather
          than replace them; a run already ENDING keeps the end it has.
2. t=0    every pod is stopped: SIGTERM, SIGKILL after 30 s (a Job: parallelism 0, its pod deleted).
3. t=0..  each pod that has ended is deleted for good (its finalizer off) and its ledger entry
          closed at its end, with its outcome.
4. t=12   none is left: R ends CANCELLED, any other open ledger entry of it closed now.

A pod still there at t=240 (its node gone, say) is deleted at once and billed to then as killed;
the pods left after that are reported, and the command fails. The state store is optional: one
that fails is left alone from then on, and the pods still go.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from contracts.status import RunStatus
from services.ports.launcher.launcher import Launcher, PodOutcome, node_names, pod_outcome
from services.ports.state.state_store import IllegalTransitionError, StateStore

log = logging.getLogger(__name__)

REASON = "spotrl was uninstalled: `spotrl teardown` stopped its pods"
POLL_S = 0.5


@dataclass
class TeardownReport:
    """What a teardown did: the runs it ended, each pod it deleted with how it ended, and the pods
    still listed at its end (none, unless the deadline passed with pods still being launched)."""

    ended_runs: list[str] = field(default_factory=list)
    pods: dict[str, PodOutcome] = field(default_factory=dict)
    left: list[str] = field(default_factory=list)


def teardown(
    launcher: Launcher, state: StateStore | None, *, grace_s: float, timeout_s: float, poll_s: float = POLL_S
) -> TeardownReport:
    """Stop and delete every pod of ``launcher`` and end every run of ``state`` (module docstring)."""
    runs = _Runs(state)
    report = TeardownReport()
    deadline = time.monotonic() + timeout_s
    stopped: set[str] = set()
    while True:
        past = time.monotonic() >= deadline
        runs.cancel_active()
        pods = launcher.list()
        for pod in pods:
            if pod.phase.is_terminal() or past:
                outcome = pod_outcome(pod) if pod.phase.is_terminal() else PodOutcome.KILLED
                for entry in node_names(pod.name, pod.nodes):
                    runs.close_ledger(entry, pod.ended_at if pod.phase.is_terminal() else None, outcome)
                launcher.delete(pod.name)  # off with the finalizer: gone for good (killed, past the deadline)
                report.pods[pod.name] = outcome
                log.info("deleted pod %s of run %s (%s)", pod.name, pod.run_id, outcome.value)
            elif pod.name not in stopped:
                log.info("stopping pod %s of run %s (grace %.0f s)", pod.name, pod.run_id, grace_s)
                launcher.stop(pod.name, grace_s)
                stopped.add(pod.name)
        if past or not pods:
            break
        time.sleep(poll_s)
    left = launcher.list()
    report.left = [p.name for p in left]
    report.ended_runs = runs.end_stopping(busy={p.run_id for p in left})
    return report


class _Runs:
    """The state store's side of a teardown. A store that fails (unreachable, or gone mid-way) is
    left alone from then on: the runs stay as they are, and the pods still go."""

    def __init__(self, state: StateStore | None) -> None:
        self.state = state

    def _do(self, what: str, action: Callable[[StateStore], Any]) -> Any:
        if self.state is None:
            return None
        try:
            return action(self.state)
        except SQLAlchemyError as e:
            log.warning("the state store failed while %s (%s); the runs are left as they are", what, e)
            self.state = None
            return None

    def cancel_active(self) -> None:
        def cancel(state: StateStore) -> None:
            for row in state.list_runs(active_only=True):
                if not RunStatus(row.status).is_stopping():
                    log.info("cancelling run %s (%s)", row.id, row.status)
                    state.begin_ending(row.id, RunStatus.CANCELLED, REASON)

        self._do("cancelling the runs", cancel)

    def close_ledger(self, pod: str, ended_at: float | None, outcome: PodOutcome) -> None:
        self._do(
            f"closing the ledger entry of {pod}",
            lambda state: state.close_ledger(pod, ended_at=ended_at or time.time(), outcome=outcome),
        )

    def end_stopping(self, busy: set[str]) -> list[str]:
        """End each stopping run that has no pod left (``busy``: the runs that have), with the end
        it was stopping with, its other open ledger entries closed now; the runs ended."""

        def end(state: StateStore) -> list[str]:
            ended = []
            for row in state.list_runs(active_only=True):
                if not RunStatus(row.status).is_stopping() or row.id in busy:
                    continue
                now = time.time()
                for entry in state.ledger(row.id):
                    if entry.ended_at is None:  # a pod no launcher lists any more: its end is unknown
                        state.close_ledger(entry.pod, ended_at=now)
                try:
                    state.set_status(
                        row.id, RunStatus(row.ending_status or RunStatus.CANCELLED), row.ending_reason or REASON
                    )
                except IllegalTransitionError as e:  # a scheduler ended it meanwhile
                    log.info("run %s: %s", row.id, e)
                    continue
                log.info("run %s ended %s", row.id, row.ending_status)
                ended.append(row.id)
            return ended

        return self._do("ending the runs", end) or []


def open_state(url: str, connect_timeout_s: int = 10) -> StateStore | None:
    """The state store at ``url``, or None (logged) when it cannot be reached: a PostgreSQL server
    is given ``connect_timeout_s`` to answer, where the driver would wait for TCP to give up."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() == "postgresql" and "connect_timeout" not in parsed.query:
        parsed = parsed.update_query_dict({"connect_timeout": str(connect_timeout_s)})
    try:
        return StateStore(parsed.render_as_string(hide_password=False))
    except SQLAlchemyError as e:
        log.warning("the state store cannot be reached (%s); the runs are left as they are", e)
        return None
