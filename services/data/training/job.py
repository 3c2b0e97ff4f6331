"""The training job: one process per iteration, started by the scheduler on an on-demand or spot node.

Iteration N takes the oldest ``batch_samples`` queued samples, in whole groups (the scheduler
starts the job once that many are waiting), drops duplicates and samples beyond the staleness bound, runs one
GRPO/PPO update of policy v(N-1) with ``trainer_core``, publishes v(N), and only then commits
its sample offsets (docs/architecture.md, delivery rules). ``result.json`` is written last; a retried job
that finds it commits the offsets recorded there and exits, so a crash between publishing and
committing trains nothing twice.

One process and a torchrun pod of several run the same path: each rank trains its share with a
``Strategy`` (``LocalStrategy`` on one process), whose optimizer state is stored under the
iteration's trainer prefix (``optimizer/``, next to the critic's ``value_head.pt``) before
``result.json``, and read back by the next iteration.

A job that may run on spot (``training.capacity`` spot, or auto) checkpoints within its update
(``update_checkpoint``): it stores its batch before the update, then the update's state every
``checkpoint_every_s`` seconds and at the provider's preemption notice (SIGTERM), after which it
exits with ``EXIT_PREEMPTED`` (75). The scheduler starts the iteration again; that job trains the
stored batch from the last complete checkpoint (``trainer_core.rl.resume``), publishes what an
uninterrupted job would have, commits the stored offsets, and deletes the checkpoint.
"""

from __future__ import annotations

import io
import logging
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from contracts.job_result import JobResult
from contracts.samples import decode_group
from contracts.training import Algorithm, Critic, TrainConfig
from services.data.policy_store import fetch_policy, publish_policy
from services.data.training.ranks import Ranks
from services.data.training.selection import Selection, even_shares, reward_metrics, select_samples, selection_metrics
from services.data.training.update_checkpoint import UpdateCheckpointStore, update_checkpoint
from services.domain.backlog import read_backlog, take_batch, trainer_consumer
from services.domain.names import UPDATE_CHECKPOINT_DIR, result_key, trainer_prefix, update_checkpoint_prefix
from services.domain.policy_rotation import MIN_KEEP
from services.domain.runspec import RunSpec
from services.ports.objects.object_store import ObjectStore
from services.ports.queue.queue import Consumer, Queue
from trainer_core.algos import AdaptiveKLController
from trainer_core.memory import MemoryMonitor
from trainer_core.models.loading import Policy, load_policy
from trainer_core.models.lora import LoraSettings, apply_lora, check_only_adapter_trains, is_lora
from trainer_core.rl.critic import ValueHead
from trainer_core.rl.distributed import shard_samples
from trainer_core.rl.micro_batches import with_auto_micro_batch
from trainer_core.rl.strategies import build_strategy
from trainer_core.rl.strategy import OPTIMIZER_FILE, LocalStrategy, Strategy
from trainer_core.rl.update import train_on_batch

log = logging.getLogger(__name__)

# Policy versions kept in the object store; older ones are deleted after each publish.
# Under an iteration's trainer prefix: the directory its strategy's `save_optimizer_state` wrote.
OPTIMIZER_DIR = "optimizer/"


def with_adapter(spec: RunSpec, policy: Policy) -> Policy:
    """`policy` with the LoRA adapter a `training.lora_rank` spec trains: added to the base
    model (v0); a later version already carries it."""
    if spec.training.lora_rank and not is_lora(policy.model):
        # A fixed seed for the adapter's random initial weights: every rank of a data-parallel
        # job, and every rerun, starts from the same adapter.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            policy.model = apply_lora(
                policy.model, LoraSettings(rank=spec.training.lora_rank, alpha=spec.training.lora_alpha)
            )
    if is_lora(policy.model):
        check_only_adapter_trains(policy.model)
    return policy


def reference_model(spec: RunSpec, policy: Policy, model_cache: Path) -> torch.nn.Module | None:
    """The frozen base model a KL term compares against, on the policy's device; None without a
    KL term, or for a LoRA policy, whose reference is its own base weights with the adapter off."""
    if spec.training.kl_coef == 0 or is_lora(policy.model):
        return None
    device = next(policy.model.parameters()).device
    return load_policy(spec.model, cache_dir=model_cache).model.to(device).eval()


def build_value_head(spec: RunSpec, policy: Policy, model_cache: Path) -> ValueHead | None:
    """The PPO critic the spec asks for (None for critic-free algorithms); a separate critic
    starts from the base model's weights."""
    if spec.training.algorithm != Algorithm.PPO:
        return None
    backbone = load_policy(spec.model, cache_dir=model_cache).model if spec.training.critic == Critic.SEPARATE else None
    return ValueHead(policy.model.config.hidden_size, backbone=backbone)


def kl_controller(spec: RunSpec, last_coef: float | None) -> AdaptiveKLController | None:
    """The adaptive KL controller of a run with `training.kl_target`, continuing from the
    coefficient the previous iteration ended with (each iteration is its own process)."""
    t = spec.training
    if t.kl_target is None:
        return None
    return AdaptiveKLController(
        init_coef=last_coef if last_coef is not None else t.kl_coef, target=t.kl_target, horizon=t.kl_horizon
    )


def _load_torch(objects: ObjectStore, key: str) -> dict | None:
    if not objects.exists(key):
        return None
    return torch.load(io.BytesIO(objects.get_bytes(key)), weights_only=True)


def _save_torch(objects: ObjectStore, key: str, obj: dict) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    objects.put_bytes(key, buf.getvalue())


def run_training_job(
    *,
    run_id: str,
    iteration: int,
    spec: RunSpec,
    queue: Queue,
    objects: ObjectStore,
    model_cache: Path,
    on_spot: bool = True,
) -> JobResult | None:
    """Train iteration ``iteration`` (v(N-1) -> vN) and return its result (None on ranks other than 0).
    ``on_spot``: whether the pod runs on spot capacity, where a run that may train on spot checkpoints
    its update (``update_checkpoint``).

    With ``training.processes`` x ``training.nodes`` > 1 every torchrun rank calls this: rank 0
    reads the batch and shares it, each rank trains its share of whole groups with
    ``training.strategy``, and rank 0 publishes, writes the result and commits.
    """
    ranks = Ranks.join(spec.training.ranks)
    consumer = trainer_consumer(queue, run_id) if ranks.leader else None
    # The machine's disk, shared by its ranks: the leader moves the update's checkpoints between it and the store.
    local = ranks.on_disk(model_cache / "runs" / run_id / f"trainer-v{iteration}-partial")
    try:
        with update_checkpoint(spec.training, objects, run_id, iteration, local, ranks, on_spot) as checkpoint:
            return _train(run_id, iteration, spec, queue, consumer, objects, model_cache, ranks, checkpoint)
    finally:
        if consumer is not None:
            consumer.close()


def _train(
    run_id: str,
    iteration: int,
    spec: RunSpec,
    queue: Queue,
    consumer: Consumer | None,
    objects: ObjectStore,
    model_cache: Path,
    ranks: Ranks,
    checkpoint: UpdateCheckpointStore | None,
) -> JobResult | None:
    """The job on every rank, one process or several alike: the leader reads and shares the batch,
    each rank trains its share with its strategy (`LocalStrategy` on one process), and the leader
    publishes v(N), stores the trainer state, writes the result and commits (module docstring).
    A spot job (`checkpoint`) trains the batch an earlier job of the iteration stored, if any, and
    otherwise stores its own before its update. One function, about 70 lines: it is the job's steps
    in their order, mostly one call each, and every rank must take the same collective steps
    (`ranks.share`, `ranks.least`, the checkpoint's) alike."""
    if objects.exists(result_key(run_id, iteration)):
        return _commit_published(objects, run_id, iteration, consumer)
    started = time.time()
    previous = JobResult.from_json(objects.get_bytes(result_key(run_id, iteration - 1))) if iteration > 1 else None
    stored = checkpoint.stored_batch() if checkpoint is not None else None
    if stored is None:
        batch = _read_batch(queue, consumer, run_id, iteration, spec, previous, ranks) if consumer is not None else None
        samples_read, offsets, selection = ranks.share(batch)
    else:
        samples_read, offsets, selection = stored.samples_read, stored.offsets, stored.selection
        _join_group(consumer)

    policy, value_head, ref_model = _load_models(objects, run_id, iteration, spec, model_cache, ranks)
    samples = shard_samples(selection.kept, ranks.rank, ranks.world_size)
    # A stored batch's micro-batches are the size its first job chose (and may have checkpointed with).
    cfg = spec.training if stored is None else spec.training.model_copy(update={"micro_batch": stored.micro_batch})
    if samples:
        # Probed on the whole (unsharded) model: a size that fits it fits its shards.
        cfg = with_auto_micro_batch(cfg, policy.model, samples, value_head=value_head, agree=ranks.least)
    if checkpoint is not None and stored is None:
        checkpoint.keep_batch(samples_read, offsets, selection, cfg.micro_batch)
    strategy = _strategy(spec, ranks, policy, cfg, value_head, ref_model)
    # The ranks of a machine share its disk: its first rank moves the optimizer state between it and the store.
    scratch = ranks.on_disk(model_cache / "runs" / run_id / f"trainer-v{iteration}")
    _load_optimizer_state(objects, trainer_prefix(run_id, iteration - 1), strategy, scratch, ranks)

    controller = kl_controller(spec, previous.metrics.get("actor/kl_coef") if previous else None)
    metrics = {}
    if samples:
        if checkpoint is not None:
            checkpoint.stop_if_noticed()
        metrics = train_on_batch(
            policy.model,
            samples,
            cfg,
            strategy,
            ref_model=ref_model,
            value_head=value_head,
            kl_controller=controller,
            checkpoint=checkpoint,
        )
    metrics.update(selection_metrics(selection, iteration - 1))  # staleness and drops, for the dashboards
    metrics.update(reward_metrics(selection.kept))
    metrics.update(MemoryMonitor().sample())  # current and peak RSS (GPU memory on CUDA); the leader's is reported
    weights = strategy.full_state_dict()
    strategy.save_optimizer_state(scratch / "out")
    ranks.share(None)  # every rank has written its part
    state_out = trainer_prefix(run_id, iteration)
    if ranks.node_leader and not ranks.leader:  # another machine's parts
        _store_trainer_state(objects, state_out, scratch, None)
    ranks.share(None)  # every machine's parts are stored
    if not ranks.leader:
        return None  # the leader publishes, writes the result and commits
    _publish_weights(objects, run_id, iteration, spec, weights, model_cache)
    _store_trainer_state(objects, state_out, scratch, value_head)
    result = JobResult(
        iteration=iteration,
        policy_version=iteration,
        mean_reward=_mean(s.reward for s in selection.kept),
        metrics=metrics,
        samples_read=samples_read,
        trained_ids=[s.sample_id for s in selection.kept],
        dropped=selection.dropped,
        offsets=offsets,
        # The whole update's: a resumed job's own and its iteration's earlier jobs' up to its checkpoint.
        seconds=time.time() - started + (checkpoint.earlier_seconds if checkpoint is not None else 0.0),
        ended_at=time.time(),
    )
    objects.put_bytes(result_key(run_id, iteration), result.to_json())
    consumer.commit(offsets)
    _retain(objects, run_id, iteration, model_cache)
    return result


def _commit_published(objects: ObjectStore, run_id: str, iteration: int, consumer: Consumer | None) -> JobResult:
    """The result of a v(N) already published (a retried job that crashed after publishing):
    the leader commits the offsets it recorded, and nothing is trained twice."""
    result = JobResult.from_json(objects.get_bytes(result_key(run_id, iteration)))
    if consumer is not None:
        log.info("v%d already published: committing its offsets and exiting", iteration)
        _join_group(consumer)
        consumer.commit(result.offsets)
    return result


def _join_group(consumer: Consumer | None) -> None:
    """Join the trainer group (the leader), so that the partitions are ours to commit, without
    reading the backlog: a job that commits offsets an earlier job of its iteration recorded."""
    if consumer is not None:
        consumer.poll(1, timeout_s=0.0)


def _read_batch(
    queue: Queue,
    consumer: Consumer,
    run_id: str,
    iteration: int,
    spec: RunSpec,
    previous: JobResult | None,
    ranks: Ranks,
) -> tuple[int, dict, Selection]:
    """The leader's batch: how many samples it read, their end offsets, and which of them are
    trained (no duplicates of `previous`'s, none too stale, as many per rank in whole groups)."""
    records, offsets = take_batch(read_backlog(queue, consumer, run_id)[0], spec.groups_per_batch)
    samples = [s for r in records for s in decode_group(r.value)]
    selection = select_samples(
        samples,
        seen=set(previous.trained_ids) if previous else set(),
        policy_version=iteration - 1,
        staleness_bound=spec.staleness_bound,
    )
    selection.kept, selection.dropped.uneven = even_shares(selection.kept, ranks.world_size)
    log.info(
        "iteration %d: %d samples read, %d kept, %d dropped",
        iteration,
        len(samples),
        len(selection.kept),
        selection.dropped.count(),
    )
    return len(samples), offsets, selection


def _load_models(
    objects: ObjectStore, run_id: str, iteration: int, spec: RunSpec, model_cache: Path, ranks: Ranks
) -> tuple[Policy, ValueHead | None, torch.nn.Module | None]:
    """Policy v(N-1) on this rank's device (with its LoRA adapter, if the spec trains one); the
    PPO critic as iteration N-1 left it, or fresh (None for critic-free algorithms); and the
    reference model of a KL term (None without one, or for a LoRA policy)."""
    policy = with_adapter(
        spec, fetch_policy(objects, run_id, iteration - 1, base_model=spec.model, model_cache=model_cache)
    )
    policy.model.to(ranks.device)
    value_head = build_value_head(spec, policy, model_cache)
    if value_head is not None:
        value_head.to(ranks.device)
        if (state := _load_torch(objects, trainer_prefix(run_id, iteration - 1) + "value_head.pt")) is not None:
            value_head.load_state_dict(state)
    return policy, value_head, reference_model(spec, policy, model_cache)


def _strategy(
    spec: RunSpec,
    ranks: Ranks,
    policy: Policy,
    cfg: TrainConfig,
    value_head: ValueHead | None,
    ref_model: torch.nn.Module | None,
) -> Strategy:
    """A `LocalStrategy` on one process; on several, the spec's data-parallel strategy (which
    shards a separate reference model too)."""
    if ranks.env is None:
        return LocalStrategy.build(policy.model, cfg, value_head=value_head)
    return build_strategy(
        spec.training.strategy,
        policy.model,
        cfg,
        value_head=value_head,
        ref_model=ref_model,
        offload_optimizer=spec.training.offload_optimizer,
    )


def _load_optimizer_state(objects: ObjectStore, state_in: str, strategy: Strategy, scratch: Path, ranks: Ranks) -> None:
    """Make a fresh `scratch` directory (its `out` for this iteration's state) and load the optimizer
    state the previous iteration stored under `state_in`, if any (a collective)."""
    stored = bool(objects.list(state_in + OPTIMIZER_DIR))
    # Written by a one-process job before the state moved into OPTIMIZER_DIR: the same file.
    legacy = not stored and objects.exists(state_in + OPTIMIZER_FILE)
    if ranks.node_leader:
        shutil.rmtree(scratch, ignore_errors=True)
        (scratch / "out").mkdir(parents=True)
        if stored:
            objects.download_dir(state_in + OPTIMIZER_DIR, scratch / "in")
        elif legacy:
            (scratch / "in").mkdir()
            (scratch / "in" / OPTIMIZER_FILE).write_bytes(objects.get_bytes(state_in + OPTIMIZER_FILE))
    ranks.share(None)  # the files are in place
    if stored or legacy:
        strategy.load_optimizer_state(scratch / "in")


def _store_trainer_state(objects: ObjectStore, state_out: str, scratch: Path, value_head: ValueHead | None) -> None:
    """Store what the next iteration resumes from under `state_out`: the optimizer state the
    machine's ranks wrote into `scratch/out` (then `scratch` is removed), and the critic's weights."""
    objects.upload_dir(scratch / "out", state_out + OPTIMIZER_DIR)
    shutil.rmtree(scratch)
    if value_head is not None:
        _save_torch(objects, state_out + "value_head.pt", value_head.state_dict())


def _retain(objects: ObjectStore, run_id: str, iteration: int, model_cache: Path) -> None:
    """Delete what no later job reads: optimizer states older than this iteration's (every such
    one: a job killed after publishing never got to delete its own), the update checkpoints of
    published iterations, this one's included (`update_checkpoint`), and this machine's cached
    copies of policy versions older than the one before it. Policy versions and trainer states in the object store are
    rotated by the scheduler (``services.domain.policy_rotation``), which knows how many to keep."""
    root = trainer_prefix(run_id, 0).removesuffix("v0/")
    # One listing for both: on S3 a paginated one, of every shard of every version kept.
    keys = objects.list(root)
    for version in _stored_versions(keys, root, "optimizer"):  # OPTIMIZER_DIR, and legacy files
        if version < iteration:
            objects.delete_prefix(trainer_prefix(run_id, version) + "optimizer")
    for version in _stored_versions(keys, root, UPDATE_CHECKPOINT_DIR):
        if version <= iteration:
            objects.delete_prefix(update_checkpoint_prefix(run_id, version))
    for cached in (model_cache / "runs" / run_id).glob("v*"):
        # Not the version before this one: a rollout worker of this machine may be loading it.
        if cached.name[1:].isdigit() and int(cached.name[1:]) <= iteration - MIN_KEEP:
            shutil.rmtree(cached, ignore_errors=True)


def _stored_versions(keys: Iterable[str], root: str, part: str) -> set[int]:
    """The versions N with one of `keys` under `root` + "vN/" + `part`."""
    pattern = re.compile(rf"{re.escape(root)}v(\d+)/{re.escape(part)}")
    return {int(m.group(1)) for key in keys if (m := pattern.match(key))}


def _publish_weights(
    objects: ObjectStore, run_id: str, version: int, spec: RunSpec, weights: dict[str, torch.Tensor], model_cache: Path
) -> None:
    """Publish policy `version` from the whole trained `weights` (`Strategy.full_state_dict`:
    gathered from the ranks' shards, or one process's own), loaded into a fresh copy of the
    policy it was trained from (the trained model itself may be sharded)."""
    policy = with_adapter(
        spec, fetch_policy(objects, run_id, version - 1, base_model=spec.model, model_cache=model_cache)
    )
    unexpected = policy.model.load_state_dict(weights, strict=False).unexpected_keys
    if unexpected:
        raise RuntimeError(f"trained weights the policy does not have: {unexpected[:5]}")
    with tempfile.TemporaryDirectory() as scratch:
        publish_policy(objects, run_id, version, policy, Path(scratch))


def _mean(values: Iterable[float]) -> float:
    vals: Sequence[float] = list(values)
    return sum(vals) / len(vals) if vals else 0.0
