"""The supervisor of one local "pod": ``python -m services.ports.launcher.local_pod <pod_dir>``.

It plays the kubelet for one container. It starts the workload from ``spec.json`` (the pod's
env added to its own; a pod of several nodes, one workload per node, each told its node's rank
and node 0's loopback address: ``node_envs``), writes the (first) workload's pid, and waits. A stop request (``stop.json``,
written by LocalLauncher.stop) gets the workload a SIGTERM at once and a SIGKILL of its whole
process group at the request's deadline. When the workload ends it writes ``exit.json``.

The supervisor holds ``supervisor.lock`` (flock) for its whole life: LocalLauncher opened and
locked it before starting this process, and the lock lives as long as any inherited copy of
the descriptor. A launcher, even a restarted one, tells a live supervisor from a dead one by
trying the lock, which cannot be fooled by a reused pid.

Only the standard library (and the launcher port's names) is imported: this starts once per
pod and should start fast.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

from services.ports.launcher.launcher import MASTER_ADDR_ENV, MASTER_PORT_ENV, NODE_RANK_ENV

SPEC_FILE = "spec.json"  # {"spec": PodSpec fields, "launched_at": unix seconds}
LOG_FILE = "pod.log"  # the workload's stdout and stderr, and the supervisor's own messages
LOCK_FILE = "supervisor.lock"
PID_FILE = "workload.pid"
STOP_FILE = "stop.json"  # {"kill_at": unix seconds}
EXIT_FILE = "exit.json"  # {"exit_code": int (negative signal number when killed), "ended_at": unix seconds}

# Shell convention for "command not found / not executable".
EXIT_CANNOT_START = 127
# Grace given when the supervisor itself is sent SIGTERM (a machine shutting down), as Kubernetes' default.
DEFAULT_GRACE_S = 30.0
# How often the supervisor looks for a stop request while the workload runs.
_TICK_S = 0.05
_PR_SET_PDEATHSIG = 1


def write_atomic(path: Path, text: str) -> None:
    """Readers see the old file or the whole new one: write aside, then rename over."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return data


def _say(message: str) -> None:
    # stderr is the pod's log file, so these lines sit among the workload's own output.
    print(f"[local_pod] {message}", file=sys.stderr, flush=True)


def _die_with_supervisor() -> None:
    """Run in the workload before exec: the kernel SIGKILLs it if the supervisor dies.

    So a dead supervisor (reported Failed) never leaves a workload running unseen, as a lost
    node takes its containers with it.
    """
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _kill_group(workload: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is already empty
        os.killpg(workload.pid, signal.SIGKILL)


def supervise(pod_dir: Path) -> None:
    """Run the pod's workload (one per node) to its end and record how it ended."""
    spec = json.loads((pod_dir / SPEC_FILE).read_text())["spec"]
    terminated_at: list[float] = []  # when the supervisor itself got SIGTERM

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        terminated_at.append(time.time())

    signal.signal(signal.SIGTERM, on_sigterm)
    workloads: list[subprocess.Popen[bytes]] = []
    try:
        for env in node_envs(spec.get("nodes", 1)):
            workloads.append(
                subprocess.Popen(
                    spec["command"],
                    env={**os.environ, **spec["env"], **env},
                    stdin=subprocess.DEVNULL,
                    # Its own process group, so the SIGKILL reaches everything it started, as a container's cgroup would.
                    start_new_session=True,
                    preexec_fn=_die_with_supervisor if sys.platform == "linux" else None,
                )
            )
    except OSError as e:
        _say(f"cannot start {spec['command']}: {e}")
        for workload in workloads:
            _kill_group(workload)
        exit_code = EXIT_CANNOT_START
    else:
        write_atomic(pod_dir / PID_FILE, str(workloads[0].pid))
        exit_code = _wait(pod_dir, workloads, terminated_at)
    for workload in workloads:
        _kill_group(workload)  # whatever the workload left behind ends with it
        workload.wait()
    write_atomic(pod_dir / EXIT_FILE, json.dumps({"exit_code": exit_code, "ended_at": time.time()}))


def node_envs(nodes: int) -> list[dict[str, str]]:
    """Each node's own environment: none for a pod of one; for several, its rank and where node 0
    listens for the rendezvous (a free loopback port), as torchrun reads them."""
    if nodes == 1:
        return [{}]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return [{NODE_RANK_ENV: str(k), MASTER_ADDR_ENV: "127.0.0.1", MASTER_PORT_ENV: str(port)} for k in range(nodes)]


def _wait(pod_dir: Path, workloads: list[subprocess.Popen[bytes]], terminated_at: list[float]) -> int:
    """Wait for the workloads, sending SIGTERM on a stop request and SIGKILL at its deadline. The
    pod's exit code is the first failed node's, which ends the others as a lost machine would
    (SIGKILL), or 0 once every node has succeeded."""
    kill_at = math.inf
    term_sent = kill_sent = False
    while True:
        codes = [w.poll() for w in workloads]
        failed = next((code for code in codes if code not in (None, 0)), None)
        if failed is not None or all(code == 0 for code in codes):
            return failed or 0
        time.sleep(_TICK_S)
        request = read_json(pod_dir / STOP_FILE)
        if request is not None:
            kill_at = min(kill_at, request["kill_at"])
        if terminated_at:
            kill_at = min(kill_at, terminated_at[0] + DEFAULT_GRACE_S)
        if kill_at < math.inf and not term_sent:
            pids = ", ".join(str(w.pid) for w in workloads)
            _say(f"stop requested: SIGTERM to pid {pids}, SIGKILL in {max(0.0, kill_at - time.time()):.1f} s")
            for workload in workloads:
                workload.send_signal(signal.SIGTERM)
            term_sent = True
        if time.time() >= kill_at and not kill_sent:
            _say(f"grace period over: SIGKILL to process group {', '.join(str(w.pid) for w in workloads)}")
            for workload in workloads:
                _kill_group(workload)
            kill_sent = True


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: python -m services.ports.launcher.local_pod <pod_dir>; got {argv[1:]}", file=sys.stderr)
        return 2
    supervise(Path(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
