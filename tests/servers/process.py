"""What every test server's process needs: a free loopback port, a wait until it answers, a
pause (the server hung or partitioned away: SIGSTOP, then SIGCONT), an end that works on a
paused one, and a wait until processes are gone."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

# The ports free_port() picks from: below Linux's ephemeral range (32768-60999 by default), so no
# outgoing connection takes a port between its pick and its server's bind. Sessions side by side
# (scripts/run_suite.py) each take a slice of their own, ``SPOTRL_TEST_PORTS=k/n`` (the k-th of n,
# from 0), so they never pick the same port at once.
PORTS = (20000, 32767)
_handed_out: set[int] = set()


def _port_range() -> tuple[int, int]:
    k, n = (int(x) for x in os.environ.get("SPOTRL_TEST_PORTS", "0/1").split("/"))
    size = (PORTS[1] - PORTS[0] + 1) // n
    return PORTS[0] + k * size, PORTS[0] + (k + 1) * size - 1


def free_port() -> int:
    """A loopback port nothing listens on now, never the same twice in a process: random in this
    session's slice of ``PORTS``."""
    low, high = _port_range()
    for _ in range(1000):
        port = random.randint(low, high)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {low}-{high} after 1000 tries")


def half_closed(port: int) -> int:
    """Connections to 127.0.0.1:``port`` that their client has closed and the server has not yet
    (TCP CLOSE_WAIT, from /proc/net/tcp): requests a resumed server has still to read and answer;
    0 once it has handled every one that waited while it was paused."""
    local = f"0100007F:{port:04X}"
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(1 for row in rows if row.split()[1] == local and row.split()[3] == "08")  # 08: CLOSE_WAIT


@contextlib.contextmanager
def paused(pid: int) -> Iterator[None]:
    """The server unresponsive while the block runs: connections are accepted by the kernel but
    nothing answers; afterwards it carries on with its data and answers what waited."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def end(proc: subprocess.Popen) -> None:
    """Terminate ``proc`` (SIGKILL after 10 s), resuming it first: a stopped process cannot act on SIGTERM."""
    if proc.poll() is not None:
        return
    os.kill(proc.pid, signal.SIGCONT)
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def wait_until_it_answers(
    proc: subprocess.Popen, name: str, answers: Callable[[], bool], log: Path, timeout_s: float, every_s: float = 0.02
) -> None:
    """Until ``answers()`` says yes (a failed attempt may raise); ``RuntimeError`` with the log's
    tail if the server exits first, or is still silent after ``timeout_s`` (then it is ended)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}: {log_tail(log)}")
        try:
            if answers():
                return
        except Exception:  # noqa: BLE001 - not up yet: refused, or no answer
            pass
        if time.monotonic() > deadline:
            end(proc)
            raise RuntimeError(f"{name} did not answer within {timeout_s} s: {log_tail(log)}")
        time.sleep(every_s)


def log_tail(log: Path, chars: int = 2000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def gone(pids: set[int] | list[int], timeout_s: float = 10.0) -> bool:
    """Whether every process of ``pids`` has ended (and been reaped) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while any(_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
