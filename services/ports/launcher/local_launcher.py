"""The launcher's embedded adapter: each pod a local process tree under a supervisor
(``services.ports.launcher.local_pod``), its state on disk; a pod of several nodes, one process
tree per node under the one supervisor."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict
from pathlib import Path

from services.ports.launcher import local_pod
from services.ports.launcher.launcher import (
    EXIT_PREEMPTED,
    PodNotFoundError,
    PodPhase,
    PodSpec,
    PodStatus,
    check_pod_name,
)
from services.ports.launcher.local_pod import (
    EXIT_FILE,
    LOCK_FILE,
    LOG_FILE,
    PID_FILE,
    SPEC_FILE,
    STOP_FILE,
)

# How long delete waits for a killed pod's supervisor to exit.
_DELETE_TIMEOUT_S = 10.0
_TAIL_BLOCK = 64 * 1024


class LocalLauncher:
    """Pods as local processes, with their state on disk under ``root/<name>/``.

    Each pod is a supervisor process (``services.ports.launcher.local_pod``) running the workload.
    Everything a status needs is in the pod's folder, so a new LocalLauncher on the same root
    (a restarted scheduler) sees the same pods: exit.json means Succeeded (code 0) or Failed;
    otherwise the pod is Running while its supervisor lives, and Failed once it is gone.
    Pods keep running when the launcher's process exits, as pods outlive a scheduler.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        # Supervisors this launcher started: polled so that none is left a zombie.
        self._children: dict[str, subprocess.Popen[bytes]] = {}

    def launch(self, spec: PodSpec) -> None:
        pod_dir = self._pod_dir(spec.name)
        self._reap()
        if pod_dir.exists():
            return
        # Prepare the pod aside and rename it into place: the rename is what claims the name, so
        # concurrent launches of one name start one pod, and no reader sees a half-made folder.
        staging = Path(tempfile.mkdtemp(dir=self.root, prefix=f".launch-{spec.name}-"))
        local_pod.write_atomic(staging / SPEC_FILE, json.dumps({"spec": asdict(spec), "launched_at": time.time()}))
        lock = os.open(staging / LOCK_FILE, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # held from here on: the pod reads as Running
            try:
                staging.rename(pod_dir)
            except OSError:  # the name was taken meanwhile
                shutil.rmtree(staging)
                return
            with (pod_dir / LOG_FILE).open("ab") as log:
                self._children[spec.name] = subprocess.Popen(
                    [sys.executable, "-m", "services.ports.launcher.local_pod", str(pod_dir)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    # Its own session: a Ctrl-C meant for the launcher's terminal does not reach the pods.
                    start_new_session=True,
                    # The supervisor inherits the locked descriptor and so holds the lock until it exits.
                    pass_fds=(lock,),
                )
        finally:
            os.close(lock)

    def list(self, run_id: str | None = None) -> list[PodStatus]:
        self._reap()
        statuses = []
        for pod_dir in sorted(self.root.iterdir()):
            if pod_dir.name.startswith("."):  # launches and deletes in progress
                continue
            status = _read_status(pod_dir)
            if status is not None and (run_id is None or status.run_id == run_id):
                statuses.append(status)
        return statuses

    def stop(self, name: str, grace_s: float) -> None:
        pod_dir = self._pod_dir(name)
        self._reap()
        if not _supervisor_alive(pod_dir):
            return
        kill_at = time.time() + max(0.0, grace_s)
        earlier = local_pod.read_json(pod_dir / STOP_FILE)
        if earlier is not None:  # a second stop can shorten the grace period, never extend it
            kill_at = min(kill_at, earlier["kill_at"])
        local_pod.write_atomic(pod_dir / STOP_FILE, json.dumps({"kill_at": kill_at}))

    def delete(self, name: str) -> None:
        pod_dir = self._pod_dir(name)
        if not pod_dir.exists():
            return
        self.stop(name, grace_s=0)
        deadline = time.monotonic() + _DELETE_TIMEOUT_S
        while _supervisor_alive(pod_dir):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"pod {name!r} did not exit within {_DELETE_TIMEOUT_S} s of SIGKILL; see {pod_dir / LOG_FILE}"
                    " and kill its processes by hand"
                )
            time.sleep(0.05)
        child = self._children.pop(name, None)
        if child is not None:
            child.wait()
        # Rename first so listers never see a half-deleted pod.
        trash = self.root / f".deleted-{name}-{uuid.uuid4().hex[:8]}"
        try:
            pod_dir.rename(trash)
        except FileNotFoundError:  # deleted meanwhile by another launcher
            return
        shutil.rmtree(trash)

    def logs(self, name: str, tail: int = 100) -> str:
        path = self._pod_dir(name) / LOG_FILE
        if not path.exists():
            raise PodNotFoundError(f"no pod {name!r} under {self.root}; LocalLauncher.list() shows the pods")
        return _tail(path, tail)

    def close(self) -> None:
        """Nothing to release: the pods' state is on disk, and the pods outlive the launcher."""

    def _pod_dir(self, name: str) -> Path:
        check_pod_name(name)
        return self.root / name

    def _reap(self) -> None:
        for name, child in list(self._children.items()):
            if child.poll() is not None:
                del self._children[name]


def _supervisor_alive(pod_dir: Path) -> bool:
    """Whether the pod's supervisor runs: it holds the flock on the lock file while it lives."""
    try:
        fd = os.open(pod_dir / LOCK_FILE, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also releases the lock if we just took it
    return False


def _read_status(pod_dir: Path) -> PodStatus | None:
    """The pod's status from its folder; None if the folder vanished (a delete in progress)."""
    meta = local_pod.read_json(pod_dir / SPEC_FILE)
    if meta is None:
        return None
    spec = PodSpec(**meta["spec"])
    ended = local_pod.read_json(pod_dir / EXIT_FILE)
    if ended is None and _supervisor_alive(pod_dir):
        phase = PodPhase.RUNNING
    else:
        # Read exit.json again: the supervisor may have written it and exited between the two checks.
        ended = ended or local_pod.read_json(pod_dir / EXIT_FILE) or {"exit_code": None, "ended_at": None}
        phase = PodPhase.SUCCEEDED if ended["exit_code"] == 0 else PodPhase.FAILED
    try:
        pid: int | None = int((pod_dir / PID_FILE).read_text())
    except FileNotFoundError:  # not started yet, or it could not start
        pid = None
    return PodStatus(
        name=spec.name,
        run_id=spec.run_id,
        role=spec.role,
        instance_type=spec.instance_type,
        capacity_type=spec.capacity_type,
        labels=spec.labels,
        phase=phase,
        exit_code=ended["exit_code"] if ended else None,
        started_at=meta["launched_at"],
        ended_at=ended["ended_at"] if ended else None,
        pid=pid,
        nodes=spec.nodes,
        # A spot "machine" taken back, as the chaos driver plays it, not a stop the scheduler asked
        # for: SIGKILLed without notice, or gone at the notice's SIGTERM with its work stored.
        preempted=spec.capacity_type == "spot"
        and ended is not None
        and ended["exit_code"] in (-signal.SIGKILL, EXIT_PREEMPTED)
        and not (pod_dir / STOP_FILE).exists(),
    )


def _tail(path: Path, lines: int) -> str:
    """The last ``lines`` lines of ``path``, reading backwards from the end (logs grow large)."""
    if lines <= 0:
        return ""
    with path.open("rb") as f:
        position = f.seek(0, os.SEEK_END)
        data = b""
        while position > 0 and data.count(b"\n") <= lines:
            step = min(_TAIL_BLOCK, position)
            position -= step
            f.seek(position)
            data = f.read(step) + data
    return "".join(data.decode(errors="replace").splitlines(keepends=True)[-lines:])
