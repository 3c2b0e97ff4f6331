"""What every test server's process needs: a free loopback port, a pause (the server hung or
partitioned away: SIGSTOP, then SIGCONT), and an end that works on a paused one."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
