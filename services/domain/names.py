"""Deterministic names shared by the scheduler and the pods: topics, groups, pods, object keys."""

from __future__ import annotations

# A pod's role: what it does for its run (each pod's label, each ledger entry's role).
ROLE_ROLLOUT = "rollout"
ROLE_TRAINING = "training"
ROLE_STANDBY = "standby"  # the warm training node between jobs (services.control.scheduler.plan's docstring)
ROLE_EVAL = "eval"
ROLE_REWARD = "reward"

ROLLOUT_GROUP = "rollout"
TRAINER_GROUP = "trainer"
# The training job is the trainer group's only member; a retried job takes over the same membership.
TRAINER_MEMBER = "trainer"


def prompts_topic(run_id: str) -> str:
    return f"{run_id}.prompts"


def samples_topic(run_id: str) -> str:
    return f"{run_id}.samples"


def training_pod_name(run_id: str, iteration: int) -> str:
    return f"{run_id}-train-{iteration}"


def rollout_pod_name(run_id: str, slot: int) -> str:
    return f"{run_id}-rollout-{slot}"


def standby_pod_name(run_id: str, after_iteration: int) -> str:
    """The warm training node kept between iterations (``services.control.scheduler.plan``'s docstring)."""
    return f"{run_id}-warm-{after_iteration}"


def reward_server_pod_name(run_id: str) -> str:
    """The pod of the run's reward server (the spec's reward_server)."""
    return f"{run_id}-reward"


def eval_pod_name(run_id: str, version: int) -> str:
    """The pod that evaluates policy ``version`` on the run's held-out prompts."""
    return f"{run_id}-eval-{version}"


def prompts_key(run_id: str) -> str:
    return f"runs/{run_id}/prompts.jsonl"


def eval_prompts_key(run_id: str) -> str:
    """The run's held-out prompt set (its spec's ``eval.prompts``), stored at submit time."""
    return f"runs/{run_id}/eval_prompts.jsonl"


def eval_result_key(run_id: str, version: int) -> str:
    """Written last by the eval pod of ``version``: its presence means that eval is done."""
    return f"runs/{run_id}/evals/v{version}.json"


def tenant_object_key(tenant: str, key: str) -> str:
    """Where a tenant's ``store://<key>`` lives: a tenant names objects in its own part of the store only."""
    return f"tenants/{tenant}/{key}"


def policy_prefix(run_id: str, version: int) -> str:
    return f"runs/{run_id}/policy/v{version}/"


def trainer_prefix(run_id: str, version: int) -> str:
    return f"runs/{run_id}/trainer/v{version}/"


# Under the trainer prefix of the version a job on spot capacity is making: its update's checkpoint.
UPDATE_CHECKPOINT_DIR = "partial/"


def update_checkpoint_prefix(run_id: str, version: int) -> str:
    """The checkpoint of the update that makes ``version``, while its job (on spot capacity) is under way."""
    return f"{trainer_prefix(run_id, version)}{UPDATE_CHECKPOINT_DIR}"


def result_key(run_id: str, version: int) -> str:
    """Written last by the training job that produces ``version``: its presence means published."""
    return f"{trainer_prefix(run_id, version)}result.json"


def leftover_key(run_id: str) -> str:
    """Samples still queued when the run ended, counted as dropped."""
    return f"runs/{run_id}/leftover.json"


def pod_logs_prefix(run_id: str) -> str:
    return f"runs/{run_id}/logs/"


def pod_log_key(run_id: str, pod: str) -> str:
    """The log of a pod that has ended, kept after the pod is gone."""
    return f"{pod_logs_prefix(run_id)}{pod}.log"


def run_id_of_pod(pod: str) -> str:
    """Inverse of the pod names above: ``run-ab12-train-3`` -> ``run-ab12``."""
    for marker in ("-train-", "-rollout-", "-warm-", "-eval-"):
        if marker in pod:
            return pod.rsplit(marker, 1)[0]
    if pod.endswith("-reward"):
        return pod.removesuffix("-reward")
    raise ValueError(
        f"{pod!r} is not a spotrl pod name (<run>-train-<N>, <run>-rollout-<slot>, <run>-warm-<N>, <run>-eval-<N> or <run>-reward)"
    )


def role_of_pod(pod: str) -> str:
    """``run-ab12-train-3`` -> ``training``, ``run-ab12-rollout-0`` -> ``rollout``, ``run-ab12-warm-2`` -> ``standby``,
    ``run-ab12-eval-2`` -> ``eval``, ``run-ab12-reward`` -> ``reward``."""
    if "-warm-" in pod:
        return "standby"
    if "-eval-" in pod:
        return "eval"
    if pod.endswith("-reward"):
        return "reward"
    return "training" if "-train-" in pod else "rollout"
