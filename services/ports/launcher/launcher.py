"""The launcher port: runs "pods" (a command with an env, on some instance type) and reports on them.

Adapters: ``LocalLauncher`` (each pod a local process tree) and ``KubernetesLauncher``
(services/ports/launcher/kubernetes_launcher.py); both pass the same contract tests
(tests/services/ports/launcher/test_launcher_contract.py).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol


class PodPhase(StrEnum):
    """Kubernetes' pod phases, less Pending and Unknown. Running -> Succeeded | Failed; both are final."""

    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"

    def is_terminal(self) -> bool:
        return self is not PodPhase.RUNNING


# Every pod finds its own name and role in its environment (its memory reports carry them), and
# its capacity type (spot or on-demand: a training job checkpoints its update on spot only).
POD_NAME_ENV = "SPOTRL_POD_NAME"
POD_ROLE_ENV = "SPOTRL_POD_ROLE"
POD_CAPACITY_ENV = "SPOTRL_POD_CAPACITY"


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
    zone: str | None = None  # the zone its node must be in; None: any (local pods have none)
    # The GPUs of its node it uses (a rollout worker's rollout.gpus_per_worker: a node holds several
    # such pods); None: all of them, one pod per node. Local pods share the machine's.
    gpus: int | None = None
    # Machines the pod spans, each running ``command`` (a training job's torchrun, told its node's
    # rank and rank 0's address by the launcher: ``NODE_RANK_ENV``, ``MASTER_ADDR_ENV``); they
    # start, run and end as one, and any node's end ends the others (``PodStatus`` is the group's).
    nodes: int = 1


TORCHRUN_SHUTDOWN_S = 3600
# How long the nodes of a job may join its rendezvous apart: each machine boots on its own.
RENDEZVOUS_TIMEOUT_S = 1800
# torchrun reads its static rendezvous from these (``--node-rank``, ``--master-addr``,
# ``--master-port``): the launcher sets them for each node of a pod of several.
NODE_RANK_ENV = "PET_NODE_RANK"
MASTER_ADDR_ENV = "PET_MASTER_ADDR"
MASTER_PORT_ENV = "PET_MASTER_PORT"
# The exit status of a pod that stopped at a spot preemption notice with its work stored, to be
# started again (sysexits' EX_TEMPFAIL): a training job that checkpointed its update.
EXIT_PREEMPTED = 75


def cli_command(args: list[str], *, processes: int = 1, nodes: int = 1, python: str = sys.executable) -> list[str]:
    """The command of a pod running ``spotrl ARGS``: one process, or ``processes`` of them on each
    of its ``nodes`` machines (one per GPU), started by torchrun, which sets each one's rank. The
    nodes of a pod of several meet at node 0 (torchrun's static rendezvous: ``NODE_RANK_ENV``,
    ``MASTER_ADDR_ENV`` and ``MASTER_PORT_ENV``, which the launcher sets on each node)."""
    module = ["-m", "services.cli.main", *args]
    if processes == 1 and nodes == 1:
        return [python, *module]
    where = (
        ["--standalone"]
        if nodes == 1
        else [f"--nnodes={nodes}", "--rdzv-backend=static", f"--rdzv-conf=timeout={RENDEZVOUS_TIMEOUT_S}"]
    )
    return [
        python,
        "-m",
        "torch.distributed.run",
        *where,
        f"--nproc_per_node={processes}",
        # On a SIGTERM (a stop, a spot notice) torchrun forwards it to the ranks, which checkpoint
        # and exit; it would SIGKILL them after 30 s, less than a spot notice: the pod's grace decides.
        f"--shutdown-timeout={TORCHRUN_SHUTDOWN_S}",
        *module,
    ]


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
    nodes: int = 1  # the machines it spans (``PodSpec.nodes``), each billed: ``node_names``
    # Kubernetes: a pod of several nodes that some of them hold and the others not yet: billed, yet
    # not started (its nodes meet first), and on spot waiting for capacity as a pod with none does.
    partly_placed: bool = False


def node_names(name: str, nodes: int) -> list[str]:
    """The names the cost ledger bills a pod's machines by: the pod's own for one, ``<name>-<k>``
    for node k of several (on Kubernetes, the hostnames of its Indexed Job's pods)."""
    return [name] if nodes == 1 else [f"{name}-{k}" for k in range(nodes)]


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


def check_pod_name(name: str) -> None:
    """ValueError unless ``name`` is a valid Kubernetes object name (an RFC 1123 label)."""
    if not _POD_NAME.fullmatch(name):
        raise ValueError(
            f"pod name {name!r} is not a valid Kubernetes name: at most 63 lowercase letters, digits"
            " and '-', starting and ending with a letter or digit"
        )
