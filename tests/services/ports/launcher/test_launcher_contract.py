"""The contract every Launcher adapter passes (production adapters join ADAPTERS), then LocalLauncher's own."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.ports.launcher.launcher import EXIT_PREEMPTED, Launcher, PodNotFoundError, PodPhase, PodSpec, PodStatus
from services.ports.launcher.local_launcher import LocalLauncher


@dataclass(frozen=True)
class Adapter:
    open: Callable[[Path], Launcher]  # a client of the pods whose state is under the folder
    python: list[str]  # the command that runs Python inside a pod
    clock_s: float = 0.0  # the resolution of the adapter's start and end times (Kubernetes': whole seconds)


def local_adapter(request: pytest.FixtureRequest) -> Adapter:
    return Adapter(open=lambda root: LocalLauncher(root / "pods"), python=[sys.executable])


def kubernetes_adapter(request: pytest.FixtureRequest) -> Adapter:
    """Launchers on a fresh namespace of the real test API server, whose pods the test's kubelet
    runs as local processes (tests/servers/kubelet.py)."""
    from tests.services.ports.launcher.kube_support import open_kubernetes_launcher

    return Adapter(open=open_kubernetes_launcher(request), python=["python"], clock_s=1.0)


# Each makes the adapter for one test (the Kubernetes one starts that test's namespace and kubelet).
ADAPTERS: dict[str, Callable[[pytest.FixtureRequest], Adapter]] = {
    "local": local_adapter,
    "kubernetes": kubernetes_adapter,
}


# Workloads that print "ready" once their signal handling is in place, so a test can stop them.
# Exits 0 on SIGTERM, but only once the file named by $RELEASE exists: the test says when, so it
# sees the pod still running after stop() returned. (An adapter whose pods do not share the test's
# file system needs another way to release it.)
TRAPS_SIGTERM = """
import os, signal, sys, time
def bye(signum, frame):
    print("bye", flush=True)
    while not os.path.exists(os.environ["RELEASE"]):
        time.sleep(0.05)
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
print("ready", flush=True)
time.sleep(60)
"""
# Logs each SIGTERM and carries on: only a SIGKILL ends it.
IGNORES_SIGTERM = """
import signal, time
signal.signal(signal.SIGTERM, lambda signum, frame: print("SIGTERM ignored", flush=True))
print("ready", flush=True)
time.sleep(60)
"""
SLEEPS = "import time; print('ready', flush=True); time.sleep(60)"
# Its child ignores SIGTERM, so only a SIGKILL of the pod's whole process group ends it.
STARTS_A_STUBBORN_CHILD = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", '''
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(60)
'''])
print("child", child.pid, flush=True)
child.wait()
"""


@pytest.fixture(params=sorted(ADAPTERS))
def adapter(request: pytest.FixtureRequest) -> Adapter:
    return ADAPTERS[request.param](request)


def cleaned_up(launcher: Launcher) -> Iterator[Launcher]:
    yield launcher
    for pod in launcher.list():  # leave no process behind
        launcher.delete(pod.name)


@pytest.fixture
def launcher(adapter: Adapter, tmp_path: Path) -> Iterator[Launcher]:
    yield from cleaned_up(adapter.open(tmp_path))


@pytest.fixture
def spec(adapter: Adapter) -> Callable[..., PodSpec]:
    """Makes the spec of a pod running Python ``code``."""
    return lambda name, code, **kwargs: python_pod(adapter.python, name, code, **kwargs)


def python_pod(
    python: list[str], name: str, code: str, *, run_id: str = "run-1", env: dict[str, str] | None = None
) -> PodSpec:
    return PodSpec(
        name=name,
        run_id=run_id,
        role="rollout",
        command=[*python, "-c", code],
        env=env or {},
        instance_type="g5.xlarge",
        capacity_type="spot",
        labels={"slot": "0"},
    )


def status(launcher: Launcher, name: str) -> PodStatus:
    (pod,) = [p for p in launcher.list() if p.name == name]
    return pod


def wait_until_ended(launcher: Launcher, name: str, timeout_s: float = 30.0) -> PodStatus:
    deadline = time.monotonic() + timeout_s
    while (pod := status(launcher, name)).phase is PodPhase.RUNNING:
        assert time.monotonic() < deadline, f"pod {name} still running after {timeout_s} s"
        time.sleep(0.05)
    return pod


def wait_for_log(launcher: Launcher, name: str, text: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in launcher.logs(name):
        assert time.monotonic() < deadline, f"{text!r} not in the log of {name}: {launcher.logs(name)!r}"
        time.sleep(0.05)


def process_runs(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not: it has ended, only its entry remains)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def my_zombies() -> list[int]:
    zombies = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rpartition(")")[2].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] == "Z" and int(fields[1]) == os.getpid():
            zombies.append(int(stat_file.parent.name))
    return zombies


def test_a_pod_that_exits_0_succeeds(launcher: Launcher, spec: Callable[..., PodSpec], adapter: Adapter) -> None:
    before = time.time() - adapter.clock_s
    launcher.launch(spec("ok", "print('hello from the pod')"))
    pod = wait_until_ended(launcher, "ok")

    assert pod.phase is PodPhase.SUCCEEDED and pod.exit_code == 0
    assert pod.ended_at is not None and before <= pod.started_at <= pod.ended_at <= time.time()
    assert (pod.run_id, pod.role, pod.instance_type, pod.capacity_type) == ("run-1", "rollout", "g5.xlarge", "spot")
    assert pod.labels == {"slot": "0"}
    assert "hello from the pod" in launcher.logs("ok")


def test_a_pod_that_exits_non_zero_fails(launcher: Launcher, spec: Callable[..., PodSpec]) -> None:
    launcher.launch(spec("bad", "import sys; print('boom', file=sys.stderr); sys.exit(3)"))
    pod = wait_until_ended(launcher, "bad")
    assert pod.phase is PodPhase.FAILED and pod.exit_code == 3
    assert "boom" in launcher.logs("bad")


def test_stop_sends_sigterm_and_a_trapping_workload_exits_cleanly(
    launcher: Launcher, spec: Callable[..., PodSpec], tmp_path: Path
) -> None:
    release = tmp_path / "release"
    launcher.launch(spec("graceful", TRAPS_SIGTERM, env={"RELEASE": str(release)}))
    wait_for_log(launcher, "graceful", "ready")

    launcher.stop("graceful", grace_s=30)
    # stop did not wait for the pod: the pod cannot end before `release` exists.
    assert status(launcher, "graceful").phase is PodPhase.RUNNING
    wait_for_log(launcher, "graceful", "bye")  # the SIGTERM reached the workload's handler
    release.touch()
    pod = wait_until_ended(launcher, "graceful")

    assert pod.phase is PodPhase.SUCCEEDED and pod.exit_code == 0  # it ended itself: no SIGKILL came


def test_a_workload_ignoring_sigterm_is_killed_after_the_grace_period(
    launcher: Launcher, spec: Callable[..., PodSpec], adapter: Adapter
) -> None:
    launcher.launch(spec("stubborn", IGNORES_SIGTERM))
    wait_for_log(launcher, "stubborn", "ready")

    stopped_at = time.time()
    launcher.stop("stubborn", grace_s=3.0)
    wait_for_log(launcher, "stubborn", "SIGTERM ignored")  # the SIGTERM came first, and did not end it
    pod = wait_until_ended(launcher, "stubborn")

    assert pod.phase is PodPhase.FAILED and pod.exit_code == -signal.SIGKILL  # not -SIGTERM
    # Killed no earlier than the grace period allows (a lower bound: a slow machine only adds to it).
    assert pod.ended_at is not None and pod.ended_at - stopped_at >= 3.0 - adapter.clock_s


# A pod of 2 nodes: node 0 says where it runs and trains on; node 1 fails once node 0 runs.
NODE_1_FAILS = """
import os, pathlib, time
marks = pathlib.Path(os.environ["MARKS"])
if os.environ["PET_NODE_RANK"] == "0":
    (marks / "node-0.pid").write_text(str(os.getpid()))
    time.sleep(60)
while not (marks / "node-0.pid").exists():
    time.sleep(0.05)
raise SystemExit(3)
"""


def test_a_pod_of_several_nodes_ends_with_its_first_failed_node(
    launcher: Launcher, adapter: Adapter, tmp_path: Path, wait_for
) -> None:
    """Its nodes start together, each told its rank; one node's failure is the pod's, and ends the
    others, as a lost machine ends a multi-node job."""
    pod_spec = dataclasses.replace(
        python_pod(adapter.python, "nodes-1", NODE_1_FAILS, env={"MARKS": str(tmp_path)}),
        role="training",
        capacity_type="on-demand",
        nodes=2,
    )
    launcher.launch(pod_spec)
    pod = wait_until_ended(launcher, "nodes-1")
    assert (pod.phase, pod.exit_code, pod.nodes, pod.preempted) == (PodPhase.FAILED, 3, 2, False)
    node_0 = int((tmp_path / "node-0.pid").read_text())
    wait_for(lambda: not process_runs(node_0), message="node 0 ended with its pod")


def test_launching_an_existing_name_is_a_no_op(launcher: Launcher, spec: Callable[..., PodSpec]) -> None:
    launcher.launch(spec("once", SLEEPS))
    wait_for_log(launcher, "once", "ready")
    first = status(launcher, "once")

    launcher.launch(spec("once", "print('second launch')"))

    assert [p.name for p in launcher.list()] == ["once"]
    again = status(launcher, "once")
    assert (again.pid, again.started_at, again.phase) == (first.pid, first.started_at, PodPhase.RUNNING)
    assert "second launch" not in launcher.logs("once")


def test_a_new_client_sees_the_same_pods(
    launcher: Launcher, spec: Callable[..., PodSpec], adapter: Adapter, tmp_path: Path
) -> None:
    launcher.launch(spec("done", "print('x')"))
    launcher.launch(spec("failed", "raise SystemExit(2)"))
    launcher.launch(spec("running", SLEEPS, run_id="run-2"))
    wait_until_ended(launcher, "done")
    wait_until_ended(launcher, "failed")
    wait_for_log(launcher, "running", "ready")

    restarted = adapter.open(tmp_path)  # a restarted scheduler
    assert restarted.list() == launcher.list()
    assert {p.name: p.phase for p in restarted.list()} == {
        "done": PodPhase.SUCCEEDED,
        "failed": PodPhase.FAILED,
        "running": PodPhase.RUNNING,
    }
    assert [p.name for p in restarted.list(run_id="run-2")] == ["running"]

    restarted.stop("running", grace_s=5)  # it can stop pods it did not start
    pod = wait_until_ended(restarted, "running")
    assert pod.phase is PodPhase.FAILED and pod.exit_code == -signal.SIGTERM


def test_the_pod_env_is_added_to_the_launchers_env(launcher: Launcher, spec: Callable[..., PodSpec]) -> None:
    code = "import os; print(os.environ['POD_VALUE'], 'PATH' in os.environ)"
    launcher.launch(spec("env", code, env={"POD_VALUE": "forty-two"}))
    assert wait_until_ended(launcher, "env").exit_code == 0
    assert "forty-two True" in launcher.logs("env")


def test_delete_kills_a_running_pod_and_forgets_it(launcher: Launcher, spec: Callable[..., PodSpec]) -> None:
    launcher.launch(spec("doomed", SLEEPS))
    wait_for_log(launcher, "doomed", "ready")

    launcher.delete("doomed")

    assert launcher.list() == []
    with pytest.raises(PodNotFoundError):
        launcher.logs("doomed")
    launcher.delete("doomed")  # deleting again is a no-op
    launcher.stop("doomed", grace_s=1)  # so is stopping a pod that is gone
    launcher.launch(spec("doomed", "print('reborn')"))  # the name is free again
    assert wait_until_ended(launcher, "doomed").phase is PodPhase.SUCCEEDED
    assert "reborn" in launcher.logs("doomed")


def test_logs_tail(launcher: Launcher, spec: Callable[..., PodSpec]) -> None:
    launcher.launch(spec("chatty", "for i in range(5000): print(f'line {i}')"))
    wait_until_ended(launcher, "chatty")
    assert launcher.logs("chatty", tail=3) == "line 4997\nline 4998\nline 4999\n"
    assert launcher.logs("chatty").count("\n") == 100
    assert launcher.logs("chatty", tail=0) == ""


def test_names_must_be_valid_kubernetes_names(launcher: Launcher, spec: Callable[..., PodSpec]) -> None:
    for bad in ["Upper", "under_score", "-dash", "a" * 64, "../escape", ""]:
        with pytest.raises(ValueError, match="Kubernetes name"):
            launcher.launch(spec(bad, "pass"))
    assert launcher.list() == []


# --- LocalLauncher only: processes, pids and the files under the root -------------------------


@pytest.fixture
def local(tmp_path: Path) -> Iterator[Launcher]:
    yield from cleaned_up(LocalLauncher(tmp_path / "pods"))


def local_spec(name: str, code: str) -> PodSpec:
    return python_pod([sys.executable], name, code)


def test_local_a_command_that_cannot_start_fails_with_127(local: Launcher) -> None:
    local.launch(PodSpec("nope", "run-1", "rollout", ["/no/such/program"], {}, "g5.xlarge", "spot"))
    pod = wait_until_ended(local, "nope")
    assert pod.phase is PodPhase.FAILED and pod.exit_code == 127 and pod.pid is None
    assert "/no/such/program" in local.logs("nope")


def test_local_a_sigkilled_workload_fails_with_minus_9(local: Launcher) -> None:
    local.launch(local_spec("victim", SLEEPS))
    wait_for_log(local, "victim", "ready")
    pid = status(local, "victim").pid
    assert pid is not None

    os.kill(pid, signal.SIGKILL)
    pod = wait_until_ended(local, "victim")
    assert pod.phase is PodPhase.FAILED and pod.exit_code == -9 and pod.pid == pid
    assert pod.preempted, "a spot pod SIGKILLed unasked is the local stand-in for a reclaimed machine"


def test_local_a_pod_killed_after_its_stop_is_not_preempted(local: Launcher) -> None:
    local.launch(local_spec("stubborn", IGNORES_SIGTERM))
    wait_for_log(local, "stubborn", "ready")
    local.stop("stubborn", grace_s=0.5)  # killed at the end of its grace period: asked to go
    pod = wait_until_ended(local, "stubborn")
    assert (pod.exit_code, pod.preempted) == (-9, False)


# Stores its work at a SIGTERM and exits EXIT_PREEMPTED, as a spot training job does at a notice.
CHECKPOINTS_AT_SIGTERM = f"""
import signal, sys, time
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit({EXIT_PREEMPTED}))
print("ready", flush=True)
time.sleep(60)
"""


def test_local_a_spot_pod_gone_at_a_notice_with_its_work_stored_is_preempted_unless_stopped(local: Launcher) -> None:
    local.launch(local_spec("noticed", CHECKPOINTS_AT_SIGTERM))
    wait_for_log(local, "noticed", "ready")
    os.kill(status(local, "noticed").pid, signal.SIGTERM)  # the provider's notice, as the chaos driver gives it
    assert (wait_until_ended(local, "noticed").exit_code, status(local, "noticed").preempted) == (EXIT_PREEMPTED, True)
    local.launch(local_spec("stopped", CHECKPOINTS_AT_SIGTERM))
    wait_for_log(local, "stopped", "ready")
    local.stop("stopped", grace_s=5)  # the scheduler's own stop: not a preemption
    assert (wait_until_ended(local, "stopped").exit_code, status(local, "stopped").preempted) == (EXIT_PREEMPTED, False)


def test_local_a_pod_whose_supervisor_died_fails_and_its_workload_dies_too(local: Launcher, wait_for) -> None:
    local.launch(local_spec("orphan", SLEEPS))
    wait_for_log(local, "orphan", "ready")
    pid = status(local, "orphan").pid
    assert pid is not None
    supervisor = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])  # the parent pid

    os.kill(supervisor, signal.SIGKILL)
    pod = wait_until_ended(local, "orphan")
    assert pod.phase is PodPhase.FAILED and pod.exit_code is None and pod.ended_at is None
    wait_for(lambda: not process_runs(pid), message="the workload died with its supervisor")


def test_local_stop_and_delete_end_the_whole_process_tree(local: Launcher, tmp_path: Path) -> None:
    local.launch(local_spec("tree", STARTS_A_STUBBORN_CHILD))
    wait_for_log(local, "tree", "ready")
    child = int(local.logs("tree").split("child ")[1].split()[0])
    workload = status(local, "tree").pid
    assert workload is not None

    local.delete("tree")

    assert not (tmp_path / "pods" / "tree").exists()
    assert not process_runs(workload) and not process_runs(child)


def test_local_finished_supervisors_are_reaped(local: Launcher, wait_for) -> None:
    for i in range(3):
        local.launch(local_spec(f"quick-{i}", "pass"))
    for i in range(3):
        wait_until_ended(local, f"quick-{i}")

    def reaped() -> bool:  # a supervisor exits just after writing exit.json
        local.list()  # reaps the launcher's finished children
        return not my_zombies()

    wait_for(reaped, message="no supervisor is left a zombie")
