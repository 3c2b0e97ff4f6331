"""A run's status: the one list of states every process and the API agree on.

Persisted in the state store and shown as is by the API. The life of a run:

    PENDING ──> RUNNING ──> ENDING ─────> SUCCEEDED | FAILED
       │           │          ^
       │           └─> CANCELLING ──> CANCELLED
       └──> CANCELLING | ENDING

CANCELLING and ENDING are the stopping states: the scheduler keeps reconciling the run until
its pods are gone, then sets the terminal status. A failure while cancelling (CANCELLING ->
ENDING) is the one way an ending changes its mind: a failure is never hidden.
"""

from __future__ import annotations

from enum import StrEnum


class RunStatus(StrEnum):
    """Where a run is in its life; ``meaning`` says it in one line."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    CANCELLING = "CANCELLING"
    ENDING = "ENDING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def meaning(self) -> str:
        return _MEANINGS[self]

    def is_terminal(self) -> bool:
        """Nothing more will happen to the run: no pod runs or will run for it."""
        return self in (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED)

    def is_stopping(self) -> bool:
        """The run's end is decided and its pods are being stopped."""
        return self in (RunStatus.CANCELLING, RunStatus.ENDING)

    def can_become(self, other: RunStatus) -> bool:
        return other in TRANSITIONS[self]


_MEANINGS: dict[RunStatus, str] = {
    RunStatus.PENDING: "Accepted and stored; the scheduler has not started it yet.",
    RunStatus.RUNNING: "Its queues exist; rollout workers and training jobs are launched as the backlog needs.",
    RunStatus.CANCELLING: "The user cancelled it; its pods are stopping, then it is CANCELLED.",
    RunStatus.ENDING: "An end condition was met (iterations, target reward, budget, failure); its pods are stopping.",
    RunStatus.SUCCEEDED: "It reached its iterations or target reward; the last policy version is published.",
    RunStatus.FAILED: "It cannot go on (budget spent, training failing, a permanent error); see the reason.",
    RunStatus.CANCELLED: "Cancelled by the user; its pods are gone.",
}

TRANSITIONS: dict[RunStatus, frozenset[RunStatus]] = {
    RunStatus.PENDING: frozenset({RunStatus.RUNNING, RunStatus.CANCELLING, RunStatus.ENDING}),
    RunStatus.RUNNING: frozenset({RunStatus.CANCELLING, RunStatus.ENDING}),
    RunStatus.CANCELLING: frozenset({RunStatus.CANCELLED, RunStatus.ENDING}),
    RunStatus.ENDING: frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED}),
    RunStatus.SUCCEEDED: frozenset(),
    RunStatus.FAILED: frozenset(),
    RunStatus.CANCELLED: frozenset(),
}
