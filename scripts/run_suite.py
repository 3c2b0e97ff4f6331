"""The whole test suite as two pytest sessions side by side, one per core (`make test` runs it).

- `slow`: the tests marked slow, one after another. Each starts real processes (pods, schedulers,
  servers) with 2 s leases and 1-2 s Kafka sessions; two of them at once on a 2-core machine
  would starve each other.
- `rest`: every other test, beside them.

Each session's test servers take ports from its own slice of ``tests.servers.process``'s range
(``SPOTRL_TEST_PORTS=k/n``), so the two never pick the same free port at once. Each line of output is
prefixed with its session's name; once both have ended, each failing session's short summary
(its `FAILED`/`ERROR` lines and the first failure's `E` lines) is printed again, last, so the end
of a long interleaved log says what failed. The exit status is the first failing
session's (pytest's own: 5, no test collected, fails too), else 0. Arguments after the script's
name go to both sessions, e.g. `--durations=20`. Ctrl-C reaches both (one process group), and
each tears down what it started.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import IO

SESSIONS = {"slow": ["-m", "slow"], "rest": ["-m", "not slow"]}  # name: pytest's selection


ERROR_LINES = 30  # of a failing session's `E` lines (the first failures' messages), printed again last


class Summary:
    """What a session said failed: its `FAILED`/`ERROR` lines, and its first `E` lines."""

    def __init__(self) -> None:
        self.failed: list[str] = []
        self.errors: list[str] = []

    def note(self, line: str) -> None:
        if line.startswith(("FAILED ", "ERROR ")):
            self.failed.append(line)
        elif line.startswith("E ") and len(self.errors) < ERROR_LINES:
            self.errors.append(line)

    def lines(self) -> list[str]:
        return self.errors + self.failed


def _relay(name: str, stream: IO[str], lock: threading.Lock, summary: Summary) -> None:
    for line in stream:
        with lock:
            sys.stdout.write(f"{name} | {line}")
            sys.stdout.flush()
        summary.note(line)


def main(args: list[str]) -> int:
    lock = threading.Lock()
    procs, relays, summaries = {}, [], {name: Summary() for name in SESSIONS}
    for k, (name, selection) in enumerate(SESSIONS.items()):
        procs[name] = proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", *selection, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env={**os.environ, "SPOTRL_TEST_PORTS": f"{k}/{len(SESSIONS)}"},
        )
        assert proc.stdout is not None
        relays.append(threading.Thread(target=_relay, args=(name, proc.stdout, lock, summaries[name])))
        relays[-1].start()
    codes = {name: proc.wait() for name, proc in procs.items()}
    for relay in relays:
        relay.join()
    for name, code in codes.items():
        if code and (lines := summaries[name].lines()):
            print(f"{name}: what failed, again", *(f"{name} | {line.rstrip()}" for line in lines), sep="\n")
    print(", ".join(f"{name}: pytest exit {code}" for name, code in codes.items()))
    return next((code for code in codes.values() if code), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
