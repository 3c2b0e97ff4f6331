"""The launcher port: runs "pods" (a command with an env, on some instance type) and reports on them.

Adapters: ``LocalLauncher`` (each pod a local process tree) and ``KubernetesLauncher``
(services/backends/kubernetes_launcher.py); both pass the same contract tests
(tests/services/backends/test_launcher_contract.py).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Protocol

from services.backends import local_pod
from services.backends.local_pod import EXIT_FILE, LOCK_FILE, LOG_FILE, PID_FILE, SPEC_FILE, STOP_FILE


class PodPhase(StrEnum):
    """Kubernetes' pod phases, less Pending and Unknown. Running -> Succeeded | Failed; both are final."""

    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"

    def is_terminal(self) -> bool:
        return self is not PodPhase.RUNNING


# Every pod finds its own name and role in its environment (its memory reports carry them).
POD_NAME_ENV = "SPOTRL_POD_NAME"
POD_ROLE_ENV = "SPOTRL_POD_ROLE"


@dataclass(frozen=True)
class PodSpec:
    name: str  # deterministic, e.g. "<run>-train-3"; launching an existing name is a no-op
    run_id: str
    role: str  # "rollout" | "training"
    command: list[str]
    env: dict[str, str]  # added to the launcher's environment
    instance_type: str
    capacity_type: str  # "spot" | "on-demand"
    labels: dict[str, str] = field(default_factory=dict)


def cli_command(args: list[str], *, processes: int = 1, python: str = sys.executable) -> list[str]:
    """The command of a pod running ``spotrl ARGS``: one process, or ``processes`` of them
    started by torchrun on the pod's machine (one per GPU), which sets each one's rank."""
    module = ["-m", "services.cli", *args]
    if processes == 1:
        return [python, *module]
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", *module]


@dataclass(frozen=True)
class PodStatus:
    name: str
    run_id: str
    role: str
    instance_type: str
    capacity_type: str
    labels: dict[str, str]
    phase: PodPhase
    exit_code: int | None  # negative signal number when killed; None while running or if unknown
    started_at: float  # unix seconds
    ended_at: float | None
    pid: int | None  # the workload process (local pods only)
    # Ended because the platform took its machine back (a spot interruption: Kubernetes'
    # DisruptionTarget condition), not by a fault of its own; its phase is then Failed.
    preempted: bool = False
    # The platform's name of the pod it runs as, where that is not ``name``: a Kubernetes Job's
    # latest pod (``<job>-xxxxx``), the name GPU exporters (dcgm-exporter's ``pod``) label it with.
    platform_name: str | None = None
    # Kubernetes: no node has held it yet (no capacity of its kind, or its node still starting),
    # so no machine is billed for it; once one has, when that node joined the cluster (``None``
    # where unknown, and for local pods, which never wait).
    waiting_for_node: bool = False
    node_joined_at: float | None = None


class PodOutcome(StrEnum):
    """How an ended pod ended, as the cost ledger keeps it (``ledger.outcome``)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"  # its command exited non-zero, or the launcher lost track of it
    KILLED = "killed"  # ended by a signal: a stop past its grace period, an OOM kill
    PREEMPTED = "preempted"  # its machine taken back (a spot interruption): PodStatus.preempted


def pod_outcome(pod: PodStatus) -> PodOutcome:
    """How ``pod`` (ended) ended: the one place that tells a preempted pod (its launcher says so:
    Kubernetes' ``DisruptionTarget`` condition) from a killed or a failed one."""
    if pod.phase == PodPhase.SUCCEEDED:
        return PodOutcome.SUCCEEDED
    if pod.preempted:
        return PodOutcome.PREEMPTED
    if pod.exit_code is not None and pod.exit_code < 0:
        return PodOutcome.KILLED
    return PodOutcome.FAILED


class PodNotFoundError(LookupError):
    """No pod has that name (never launched, or deleted)."""


class Launcher(Protocol):
    def launch(self, spec: PodSpec) -> None:
        """Start a pod; a no-op if a pod of that name exists (AlreadyExists is success)."""
        ...

    def list(self, run_id: str | None = None) -> list[PodStatus]:
        """Every pod not yet deleted (of ``run_id`` if given), sorted by name."""
        ...

    def stop(self, name: str, grace_s: float) -> None:
        """Without waiting: SIGTERM the pod now, SIGKILL it after ``grace_s`` if it still runs.

        A no-op for a pod that has ended or does not exist.
        """
        ...

    def delete(self, name: str) -> None:
        """Forget the pod, killing it first if it runs (call stop first to let it end gracefully).

        A no-op for a pod that does not exist.
        """
        ...

    def logs(self, name: str, tail: int = 100) -> str:
        """The last ``tail`` lines of the pod's output; PodNotFoundError for an unknown pod."""
        ...

    def close(self) -> None:
        """Release what the launcher holds open (watches, connections); its pods run on."""
        ...


# Kubernetes object names used as labels: RFC 1123 labels.
_POD_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
# How long delete waits for a killed pod's supervisor to exit.
_DELETE_TIMEOUT_S = 10.0
_TAIL_BLOCK = 64 * 1024


def check_pod_name(name: str) -> None:
    """ValueError unless ``name`` is a valid Kubernetes object name (an RFC 1123 label)."""
    if not _POD_NAME.fullmatch(name):
        raise ValueError(
            f"pod name {name!r} is not a valid Kubernetes name: at most 63 lowercase letters, digits"
            " and '-', starting and ending with a letter or digit"
        )


class LocalLauncher:
    """Pods as local processes, with their state on disk under ``root/<name>/``.

    Each pod is a supervisor process (``services.backends.local_pod``) running the workload.
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
                    [sys.executable, "-m", "services.backends.local_pod", str(pod_dir)],
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
        # A spot "machine" taken back without notice, as the chaos driver plays it: SIGKILLed
        # without being asked to stop.
        preempted=spec.capacity_type == "spot" and ended is not None
        and ended["exit_code"] == -signal.SIGKILL and not (pod_dir / STOP_FILE).exists(),
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
