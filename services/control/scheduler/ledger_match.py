"""The ledger matched to the pods, first thing every tick (``services.control.scheduler.plan``): every pod
billed while a machine is there for it, and no entry open without a pod.

A pod without an entry (or a running one
whose entry is closed) is billed from its start (``BillPod``); an ended pod whose entry is still
open is closed at the pod's observed end (``CloseEntry`` with its outcome: a scheduler died, or a
later action of its tick failed, before reaping it, so the entry is not billed on up to now);
and an open entry without a pod is closed with nothing billed (``CloseEntry`` at its start: its
scheduler died between opening the entry and launching the pod, which therefore never started).
An entry whose pod waits for a node starts later (``DeferEntry``): no machine is billed before one
is started for it.

A pod of several nodes (a multi-node training job) has an entry per node (``node_names``), all
matched to the pod alike: its nodes start, run and end together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.control.cost.billing import NODE_BOOT_SECONDS
from services.ports.launcher.launcher import PodOutcome, PodPhase, PodStatus, node_names, pod_outcome

if TYPE_CHECKING:
    from services.control.scheduler.run_state import Observed

# How far a waiting pod's ledger entry may lag ``now - NODE_BOOT_SECONDS`` before it is moved on.
DEFER_STEP_SECONDS = 60.0


@dataclass(frozen=True)
class BillPod:
    """Open the ledger entry of a pod that has none, from its start: its scheduler died between
    launching and billing it (a standby took over)."""

    pod: PodStatus
    node: int = 0  # which of its nodes: the entry is ``node_names(pod.name, pod.nodes)[node]``

    @property
    def entry(self) -> str:
        return node_names(self.pod.name, self.pod.nodes)[self.node]


@dataclass(frozen=True)
class CloseEntry:
    """Close an open ledger entry at ``ended_at``: an ended pod's at its observed end, with how it
    ended (``outcome``); one whose pod does not exist at its start, nothing billed (``outcome``
    None: its scheduler died between opening it and launching the pod)."""

    pod: str
    ended_at: float
    outcome: PodOutcome | None = None


@dataclass(frozen=True)
class DeferEntry:
    """Start an open ledger entry's bill later, at ``started_at``: its pod waited for a node, and
    no machine was billed for it before then (``services.control.cost.billing``'s ``NODE_BOOT_SECONDS``)."""

    pod: str
    started_at: float


LedgerAction = BillPod | CloseEntry | DeferEntry


def match_ledger(observed: Observed) -> list[LedgerAction]:
    """Every pod billed while it runs, and no entry open without a pod (module docstring)."""
    machines = [(name, node, p) for p in observed.pods for node, name in enumerate(node_names(p.name, p.nodes))]
    actions: list[LedgerAction] = [
        BillPod(p, node)
        for name, node, p in machines
        if name not in observed.billed
        # Running, yet its entries are closed: its launch raised (the entry was closed) but the pod started.
        or (p.phase == PodPhase.RUNNING and name not in observed.open_entries)
    ]
    actions += [
        CloseEntry(name, p.ended_at, pod_outcome(p))
        for name, _, p in machines
        # Ended while its entry stayed open: bill it up to its end, not up to now. (An end the
        # launcher does not know is closed by ReapPod, at the tick that sees the pod ended.)
        if p.phase != PodPhase.RUNNING and p.ended_at is not None and name in observed.open_entries
    ]
    listed = {name for name, _, _ in machines}
    actions += [CloseEntry(pod, started) for pod, started in sorted(observed.open_entries.items()) if pod not in listed]
    return actions + _defer_unplaced(machines, observed)


def _defer_unplaced(machines: list[tuple[str, int, PodStatus]], observed: Observed) -> list[LedgerAction]:
    """Entries opened at launch whose pods waited for a node: billed from ``NODE_BOOT_SECONDS``
    before their node joined (a machine may boot that long unseen), not from their launch. While
    a pod still waits, its entry's start follows ``now - NODE_BOOT_SECONDS``, a step of
    ``DEFER_STEP_SECONDS`` at a time (one write a minute, not one a tick); once its node has
    joined, it moves to that node's start. A pod that ends without ever having a node is billed
    at most a boot and a step."""
    actions: list[LedgerAction] = []
    for name, _, pod in machines:
        start = observed.open_entries.get(name)
        if start is None or pod.phase != PodPhase.RUNNING:
            continue
        if pod.waiting_for_node and observed.now - NODE_BOOT_SECONDS - start > DEFER_STEP_SECONDS:
            actions.append(DeferEntry(name, observed.now - NODE_BOOT_SECONDS))
        elif pod.node_joined_at is not None and pod.node_joined_at - NODE_BOOT_SECONDS > start:
            actions.append(DeferEntry(name, pod.node_joined_at - NODE_BOOT_SECONDS))
    return actions
