"""Leadership among schedulers: one lease in the state store, renewed every tick by its holder.

Any number of ``spotrl scheduler`` processes (and ``spotrl serve`` with its embedded loop) may
run on one store; the one holding the lease reconciles, the others stand by. An example with a
10 s lease and 0.5 s ticks:

1. t=0     A creates the lease and reconciles; B's compare-and-set fails: B stands by.
2. t=0.5.. A renews it every tick (expiry = now + 10 s); B keeps trying and failing.
3. t=30.2  A is killed (its last renewal was at t=30.0: the lease runs to t=40.0).
4. t=40.0+ B's next try finds the lease expired, takes it and reconciles from the store: the
           runs, the pods and the ledger are all there, and names are deterministic.

A scheduler that stops cleanly releases the lease, so its successor takes over within a tick.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid

from services.ports.state.state_store import StateStore

log = logging.getLogger(__name__)

SCHEDULER_LEASE = "scheduler"


class Leadership:
    """This process's claim on a lease: ``hold`` at each tick, ``leads`` before each run's actions."""

    def __init__(self, state: StateStore, seconds: float, name: str = SCHEDULER_LEASE) -> None:
        self.state = state
        self.seconds = seconds
        self.name = name
        # Unique per process and instance; host and pid say who leads in `leases.holder`.
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._valid_until = 0.0  # monotonic: a conservative end of the lease we hold
        self._leading: bool | None = None  # as of the last hold; None before the first

    def hold(self) -> bool:
        """Take or renew the lease; True while this process leads."""
        asked_at = time.monotonic()  # before the write: the lease surely lasts from here
        leading = self.state.acquire_lease(self.name, self.holder, self.seconds)
        self._valid_until = asked_at + self.seconds if leading else 0.0
        if leading != self._leading:
            if leading:
                log.info("scheduler %s leads (lease %r, %.0f s)", self.holder, self.name, self.seconds)
            else:
                log.info("scheduler %s stands by: %s leads", self.holder, self.state.lease_holder(self.name))
        self._leading = leading
        return leading

    def leads(self) -> bool:
        """Whether the lease from the last ``hold`` is surely still ours, without asking the store:
        a tick that ran longer than the lease stops rather than act beside a new leader."""
        return time.monotonic() < self._valid_until

    def release(self) -> None:
        """Give the lease up (clean shutdown), so that a standby takes over at its next tick."""
        if self._leading:
            self.state.release_lease(self.name, self.holder)  # only if still ours
            log.info("scheduler %s released the lease %r", self.holder, self.name)
        self._valid_until = 0.0
        self._leading = False
