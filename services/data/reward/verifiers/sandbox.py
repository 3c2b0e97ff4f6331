"""Run an untrusted Python program: no network, no credentials, bounded resources, nothing left behind.

Every run gets, whatever the host:
- an empty environment (no credential of the server reaches the program) and `python -I -S`: no
  PYTHON* variables, no site-packages, no user site; the standard library only;
- a private working directory, deleted after, and a session of its own, killed as a group at the end;
- rlimits on CPU seconds, address space, file size and processes; a wall-clock limit; a cap on its output.

As root (CAP_SETUID), a uid of its own, `UID_BASE + slot`, one per concurrent run, locked across
processes. RLIMIT_NPROC counts the processes of a real uid and is not enforced for root, so only
under a uid of its own is a fork bomb bounded; the uid can write nowhere but its directory and the
world-writable ones, and cannot signal other runs (`kill(-1)` reaches its own uid only).

With CAP_SYS_ADMIN too (a privileged container, or a VM), network, mount and pid namespaces of its
own (see `sandbox_launcher`): no interface but a loopback that is down, so every connect fails;
private, size-capped tmpfs over the host's world-writable directories; its own /proc; and the end of
its pid namespace kills every process it started. Without namespaces, every process of the run's
uid is killed after the run and its files in those directories removed.

Without namespaces or a uid of its own (a server that is not root, as in the rollout image), an audit
hook installed before the program (`sandbox_guard`) refuses sockets, ctypes, starting programs,
reading files outside its directory and the standard library, and changing files outside its
directory: a weaker guard, since it lives in the program's own interpreter; and RLIMIT_NPROC then
counts the server uid's processes too. `host_isolation()` says what this host gives.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import functools
import json
import logging
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from services.core.safe_regex import RewardError
from services.data.reward.verifiers.sandbox_launcher import PRIVATE_DIRS

log = logging.getLogger(__name__)

# Uids of runs: [UID_BASE, UID_BASE + UID_SLOTS) for runs, UID_BASE + UID_SLOTS to probe the host.
# Debian leaves 64000-64999 unassigned, and they stay below 65536, which user namespaces of
# containers usually map.
UID_BASE = 64000
UID_SLOTS = 512
_STDERR_KEPT = 64 * 1024
_LAUNCHER = str(Path(__file__).resolve().with_name("sandbox_launcher.py"))
_LAUNCHER_FAILED = 125  # the launcher's exit code when it could not isolate the program
_MARK = "spotrl-sandbox: "


class SandboxError(RewardError):
    """The sandbox itself failed (not the program in it): no uid free, a namespace refused."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run of a program may use."""

    wall_s: float = 6.0  # wall-clock seconds before the run is killed (sleeping and blocking count)
    cpu_s: int = 4  # RLIMIT_CPU: CPU seconds, then SIGXCPU (SIGKILL a second later)
    memory_bytes: int = 512 * 2**20  # RLIMIT_AS: address space; allocations beyond fail (MemoryError)
    file_bytes: int = 16 * 2**20  # RLIMIT_FSIZE per file written; also the size of each private tmpfs
    max_processes: int = 16  # RLIMIT_NPROC: processes and threads of the run's uid
    max_output_bytes: int = 2**20  # stdout kept; a program writing more is killed


DEFAULT_LIMITS = SandboxLimits()


class Killed(str, enum.Enum):
    """Why a run ended before its program did."""

    TIMEOUT = "timeout"  # the wall-clock limit
    CPU = "cpu"  # RLIMIT_CPU
    MEMORY = "memory"  # RLIMIT_AS (the program died of a MemoryError)
    FILE_SIZE = "file_size"  # RLIMIT_FSIZE (a write failed with EFBIG)
    OUTPUT = "output"  # more than max_output_bytes of stdout


@dataclass(frozen=True)
class SandboxResult:
    """What a run printed and how it ended."""

    stdout: str
    stderr: str  # its last 64 KiB
    exit_code: int | None  # negative: the signal that ended it; None: killed before it exited
    killed: Killed | None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed is None


@dataclass(frozen=True)
class Isolation:
    """The mechanisms a run uses beyond those every run gets (see the module's docstring)."""

    namespaces: bool  # own network, mount and pid namespaces (needs CAP_SYS_ADMIN)
    uid_base: int | None  # runs under uids from uid_base (needs root); None: under the server's uid
    python: str  # the interpreter of programs: one the runs' uids can execute


# Scripts passed to interpreters as `-c` text, so that the runs' uids need not read this package.
_GUARD = Path(__file__).with_name("sandbox_guard.py").read_text()
_SWEEP = Path(__file__).with_name("sandbox_sweep.py").read_text()


def run(
    program: str, stdin: str = "", limits: SandboxLimits = DEFAULT_LIMITS, *, isolation: Isolation | None = None
) -> SandboxResult:
    """Run `program` (Python source) with `stdin`, isolated as `isolation` says (by default the most
    this host allows, `host_isolation()`). Raises SandboxError only if the sandbox itself failed.

    >>> run("print(int(input()) * 2)", "21").stdout
    '42\\n'
    """
    isolation = isolation or host_isolation()
    argv = [isolation.python, "-I", "-S", "-B", "-X", "utf8"]
    # The guard also where the program would run as root: namespaces do not keep root from the host's files.
    argv += ["main.py"] if isolation.namespaces and isolation.uid_base is not None else ["-c", _GUARD, "main.py"]
    with (
        tempfile.TemporaryDirectory(prefix="spotrl-sandbox-") as workdir,
        _uid_slot(isolation) as uid,
        tempfile.TemporaryFile() as stdin_file,
    ):
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(program)
        if uid is not None:
            os.chown(workdir, uid, uid)
        stdin_file.write(stdin.encode())
        stdin_file.seek(0)
        cfg = {
            "namespaces": isolation.namespaces,
            "tmpfs_bytes": limits.file_bytes,
            "uid": uid,
            "argv": argv,
            "workdir": workdir,
            "mark": _MARK,
            "failed": _LAUNCHER_FAILED,
            "rlimits": {
                "RLIMIT_CPU": (limits.cpu_s, limits.cpu_s + 1),
                "RLIMIT_AS": (limits.memory_bytes,) * 2,
                "RLIMIT_FSIZE": (limits.file_bytes,) * 2,
                "RLIMIT_NPROC": (limits.max_processes,) * 2,
                "RLIMIT_CORE": (0, 0),
            },
        }
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", _LAUNCHER, json.dumps(cfg)],
            stdin=stdin_file,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env={},
            start_new_session=True,
        )
        try:
            stdout, stderr, killed = _collect(proc, limits)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its session's group, whether or not it has exited
            proc.wait()  # reaped only now (see _exited)
            proc.stdout.close()
            proc.stderr.close()
    err = stderr[-_STDERR_KEPT:].decode("utf-8", "replace")
    if proc.returncode == _LAUNCHER_FAILED and err.startswith(_MARK):
        raise SandboxError(f"the sandbox could not start a program: {err.strip()}")
    return SandboxResult(
        stdout.decode("utf-8", "replace"),
        err,
        None if killed else proc.returncode,
        killed or _why_ended(proc.returncode, err),
    )


def _collect(proc: subprocess.Popen[bytes], limits: SandboxLimits) -> tuple[bytes, bytes, Killed | None]:
    """Read the program's stdout and stderr until it exits (or the limits end it)."""
    deadline = time.monotonic() + limits.wall_s
    out, err, killed = bytearray(), bytearray(), None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                killed = Killed.TIMEOUT
                break
            # Pipes reach EOF when the program exits, unless a child of it still holds them: then
            # its exit is noticed within 0.1 s.
            events = sel.select(min(remaining, 0.1))
            if not events and _exited(proc.pid):
                break
            for key, _ in events:
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                key.data.extend(chunk)
                if len(err) > 2 * _STDERR_KEPT:
                    del err[:-_STDERR_KEPT]
            if len(out) > limits.max_output_bytes:
                killed = Killed.OUTPUT
                break
    while killed is None and not _exited(proc.pid):  # it closed its pipes but runs on, or is exiting
        if time.monotonic() >= deadline:
            killed = Killed.TIMEOUT
        time.sleep(0.005)
    return bytes(out[: limits.max_output_bytes]), bytes(err), killed


def _exited(pid: int) -> bool:
    """Whether the child `pid` has exited, leaving it unreaped: until it is reaped its pid, which is
    its process group's id, cannot be reused, so that killing the group cannot reach another one."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _why_ended(exit_code: int, stderr: str) -> Killed | None:
    """Which limit ended a program that exited by itself, if one did."""
    if exit_code in (-signal.SIGXCPU, -signal.SIGKILL):  # SIGKILL: the hard CPU limit (we had not killed it)
        return Killed.CPU
    if exit_code != 0 and "MemoryError" in stderr[-2000:]:
        return Killed.MEMORY
    if exit_code == -signal.SIGXFSZ or (
        exit_code != 0 and ("File too large" in stderr[-2000:] or "No space left" in stderr[-2000:])
    ):
        return Killed.FILE_SIZE  # Python ignores SIGXFSZ: the write fails with EFBIG (or ENOSPC on the private tmpfs)
    return None


@contextlib.contextmanager
def _uid_slot(isolation: Isolation) -> Iterator[int | None]:
    """A uid no other run uses meanwhile (in any process: a lock file per uid), swept after the run."""
    if isolation.uid_base is None:
        yield None
        return
    locks = _lock_dir()
    for uid in range(isolation.uid_base, isolation.uid_base + UID_SLOTS):
        fd = os.open(os.path.join(locks, str(uid)), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            if os.pread(fd, 5, 0) == b"dirty":  # its last run's sweep failed, or its server died mid-run
                _sweep(uid, isolation.python)
            os.pwrite(fd, b"dirty", 0)
            yield uid
        finally:
            # With namespaces, the end of the run's pid namespace has killed all of the uid's processes.
            if isolation.namespaces or _sweep(uid, isolation.python):
                os.ftruncate(fd, 0)
            os.close(fd)
        return
    raise SandboxError(f"all {UID_SLOTS} sandbox uids are in use")


def _sweep(uid: int, python: str) -> bool:
    """Kill every process of `uid` and remove its files in world-writable directories; whether that worked."""
    try:
        done = subprocess.run(
            [python, "-I", "-S", "-c", _SWEEP, *PRIVATE_DIRS],
            check=False,
            user=uid,
            group=uid,
            extra_groups=[],
            env={},
            cwd="/",
            capture_output=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        log.warning("could not sweep sandbox uid %d within 30 s", uid)
        return False
    if done.returncode != 0:
        log.warning("could not sweep sandbox uid %d: %s", uid, done.stderr.decode("utf-8", "replace")[-500:])
    return done.returncode == 0


@functools.cache
def _lock_dir() -> str:
    """A directory only root can write, for the uids' lock files."""
    path = os.path.join("/run" if os.path.isdir("/run") else tempfile.gettempdir(), "spotrl-sandbox-uids")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise SandboxError(f"{path} is not a directory that only this server's uid may write")
    return path


@functools.cache
def host_isolation() -> Isolation:
    """The most isolation this host allows (probed once per process, by starting a few processes)."""
    if os.geteuid() != 0:
        return Isolation(namespaces=False, uid_base=None, python=sys.executable)
    probe_uid = UID_BASE + UID_SLOTS
    # The server's own interpreter may lie where other uids cannot reach (/root/.pyenv/...).
    candidates = dict.fromkeys(
        [sys.executable, os.path.realpath(sys.executable), shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")]
    )
    python = next((p for p in candidates if p and _runs_as(p, probe_uid)), None)
    with tempfile.TemporaryDirectory(prefix="spotrl-sandbox-") as workdir:
        open(os.path.join(workdir, "main.py"), "w").close()
        cfg = {
            "namespaces": True,
            "tmpfs_bytes": 2**20,
            "uid": None,
            "argv": [sys.executable, "-I", "-S", "main.py"],
            "workdir": workdir,
            "mark": _MARK,
            "failed": _LAUNCHER_FAILED,
            "rlimits": {},
        }
        launched = subprocess.run(
            [sys.executable, "-I", "-S", _LAUNCHER, json.dumps(cfg)],
            check=False,
            env={},
            cwd=workdir,
            capture_output=True,
        )
    namespaces = launched.returncode == 0
    if python is None:
        log.warning(
            "no interpreter runs under an unprivileged uid here: programs run as root, with RLIMIT_NPROC not enforced"
        )
        return Isolation(namespaces=namespaces, uid_base=None, python=sys.executable)
    return Isolation(namespaces=namespaces, uid_base=UID_BASE, python=python)


def _runs_as(python: str, uid: int) -> bool:
    """Whether `uid` can run the interpreter `python` (every directory on its path, and its library's)."""
    try:
        done = subprocess.run(
            [python, "-I", "-S", "-c", "pass"],
            check=False,
            user=uid,
            group=uid,
            extra_groups=[],
            env={},
            cwd="/",
            capture_output=True,
        )
    except OSError:  # exec refused: a directory on the way is closed to the uid
        return False
    return done.returncode == 0
