"""Colocated mode (``spotrl train --colocated SPEC``): rollout and training in one process on
one device, with no queue, no scheduler and no object store between them.

The hybrid engine (`trainer_core.rl.hybrid`) keeps one copy of the actor's weights: `HFEngine`
samples from the very model object that `train_on_batch` updates in place (generation runs it
in eval mode under no_grad with a KV cache; training switches it to train mode and back). So every batch is
exactly on-policy, and the device holds the weights once, plus the optimizer state.

One iteration is what the disaggregated run does across pods, in one place: take the next
``groups_per_batch`` (``batch_samples / samples_per_prompt``) prompts of the cycled prompt set
(as the scheduler publishes them), sample ``samples_per_prompt`` completions of each (as a
rollout worker does), score them with the spec's reward terms, update the policy once (as a
training job does), and write a checkpoint. ``resume=True`` continues after the latest checkpoint in the
output directory, RNG states included, so a resumed run trains to the same weights as an
uninterrupted one with the same seed.

With ``rollout.engine: vllm`` (a CUDA GPU), vLLM samples instead, from its own copy of the
weights: it sleeps while the hybrid engine trains (level 2, dropping weights the update replaces;
level 1 for LoRA runs, whose base weights it keeps in CPU memory), then takes the new weights in
process (full weights) or the saved adapter (LoRA), and wakes for the next rollout.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from pydantic import ValidationError

from services.data.reward.functions import RewardInput, prepare_terms, total_rewards
from services.data.rollout.vllm_engine import build_vllm_engine
from services.data.rollout.worker import build_samples, reward_source
from services.data.training.job import build_value_head, kl_controller, reference_model, with_adapter
from services.domain.prompt_items import PromptItem, cycled_messages
from services.domain.prompts import load_prompts
from services.domain.run_end import run_end
from services.domain.runspec import COLOCATED, RolloutEngine, RunSpec
from services.ports.objects.object_store import ObjectStore
from services.ports.prices.catalog import load_catalog
from trainer_core.engines.hf import Completion, SamplingParams
from trainer_core.engines.vllm import VLLMEngine
from trainer_core.models.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trainer_core.models.loading import encode_prompt, load_policy, save_policy
from trainer_core.models.lora import is_lora
from trainer_core.rl.hybrid import HybridEngine

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
POLICY_DIR = "policy"
VLLM_ADAPTERS_DIR = "vllm-adapters"  # the adapter vLLM serves in a colocated LoRA run
WORKER_ID = "colocated"
# Spec fields that a resumed run may change: when to stop, not what an iteration does.
_GOAL_FIELDS = frozenset({"name", "iterations", "target_mean_reward", "budget_dollars"})
# Names the group ids of a run's samples: uuid5 of (run, iteration, prompt), so that a
# resumed run builds exactly the batches an uninterrupted one does.
_GROUP_NAMESPACE = uuid.UUID("6c0b7a53-52d1-4d3e-9a47-3c1f1c2f7a10")


class SpecFileError(ValueError):
    """The run spec file cannot be read or is not a valid run spec; the message says why."""


class ResumeError(ValueError):
    """The output directory does not fit the run: checkpoints without resume, or of another spec."""


def load_spec_file(path: Path) -> RunSpec:
    """The run spec in a YAML (``.yaml``/``.yml``) or JSON file, validated as ``POST /v1/runs`` does
    and refused where a colocated run cannot honour it (``RunSpec.check_colocated``)."""
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecFileError(f"cannot read run spec {path}: {e.strerror}") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml  # PyYAML, a dependency of transformers

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise SpecFileError(f"{path} is not valid YAML: {e}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecFileError(f"{path} is not valid JSON (name YAML files .yaml or .yml): {e}") from None
    if not isinstance(data, dict):
        raise SpecFileError(f"{path} must hold a mapping of run spec fields, not {type(data).__name__}")
    try:
        return RunSpec.model_validate(data, context=COLOCATED)
    except ValidationError as e:
        raise SpecFileError(f"{path} is not a valid run spec:\n{e}") from None


@dataclass(frozen=True)
class IterationRecord:
    """What one colocated iteration did."""

    iteration: int
    mean_reward: float
    samples: int
    rollout_seconds: float
    train_seconds: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class CostLine:
    """The bill of a colocated run: its wall time on the spec's training instance, on-demand."""

    instance_type: str
    price_per_hour: float  # on-demand
    currency: str
    wall_seconds: float  # all segments of the run, resumed ones included

    @property
    def dollars(self) -> float:
        return self.wall_seconds * self.price_per_hour / 3600.0

    def __str__(self) -> str:
        return (
            f"cost: {self.wall_seconds:.1f} s wall x {self.price_per_hour:.4f} {self.currency}/h "
            f"({self.instance_type}, on-demand) = {self.dollars:.4f} {self.currency}"
        )


@dataclass(frozen=True)
class ColocatedResult:
    iterations: list[IterationRecord]  # every iteration of the run, those before a resume too
    stop_reason: str  # "iterations" | "target_mean_reward" | "budget_dollars"
    policy_dir: Path  # the final policy, loadable with load_policy
    cost: CostLine


class VLLMSampler:
    """vLLM sampling for a hybrid engine: asleep while it trains, then given the updated weights."""

    def __init__(self, vllm: VLLMEngine, hybrid: HybridEngine, adapters_dir: Path) -> None:
        self.vllm = vllm
        self.hybrid = hybrid
        self.adapters_dir = adapters_dir
        shutil.rmtree(adapters_dir, ignore_errors=True)  # an earlier segment's, if resumed
        self._pushes = 0

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        # Seeded from the torch RNG, which the checkpoints carry, as HFEngine samples from it.
        completions = self.vllm.generate(prompts, params, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
        assert completions is not None  # no should_stop given
        return completions

    @contextmanager
    def training(self) -> Iterator[None]:
        """Around an update of the hybrid engine's weights: vLLM frees the GPU, then serves them."""
        self.vllm.sleep(level=1 if is_lora(self.hybrid.model) else 2)
        yield
        self.push()

    def push(self) -> None:
        """Serve the hybrid engine's current weights: the model's in process, or its adapter,
        saved to a new directory (vLLM caches adapters by id and reads each from disk once)."""
        model = self.hybrid.model
        if not is_lora(model):
            self.vllm.set_model(model)
            return
        self._pushes += 1
        adapter = self.adapters_dir / f"{self._pushes}"
        model.save_pretrained(adapter)
        self.vllm.set_lora(adapter)
        shutil.rmtree(self.adapters_dir / f"{self._pushes - 1}", ignore_errors=True)  # no longer served


def stop_reason(spec: RunSpec, history: Sequence[IterationRecord], dollars: float = 0.0) -> str | None:
    """The spec field that ends the run after `history`, having spent `dollars` (``run_end``,
    as the scheduler decides), or None while it goes on."""
    end = run_end(
        spec,
        iterations_done=len(history),
        last_mean_reward=history[-1].mean_reward if history else None,
        spent_dollars=dollars,
    )
    return None if end is None else end.goal


def run_colocated(
    spec: RunSpec,
    *,
    out_dir: Path,
    model_cache: Path,
    objects: ObjectStore | None = None,
    resume: bool = False,
    seed: int = 0,
    device: str | None = None,
    run_id: str = "colocated",
    keep_checkpoints: int = 3,
    on_iteration: Callable[[IterationRecord], None] | None = None,
) -> ColocatedResult:
    """Train `spec` colocated until its goal, checkpointing into `out_dir/checkpoints` after
    every iteration and writing the final policy to `out_dir/policy`.

    Without `resume`, `out_dir` must hold no checkpoint (so a run is never silently mixed with
    another). With it, the run continues after the latest checkpoint, which must have been
    written for the same spec but for its goal (e.g. more `iterations` extend a finished run);
    with none, it starts afresh. The run stops at its goal, or once its wall time on the
    spec's training instance, at the on-demand price, reaches `budget_dollars`.
    """
    spec.check_colocated()
    started = time.monotonic()
    out_dir = Path(out_dir)
    checkpoints = out_dir / CHECKPOINTS_DIR
    items = load_prompts(spec.prompts, objects, fields=spec.dataset)
    prepare_terms(spec.reward)
    price = load_catalog().get(spec.training.instance_type)
    config = {"spec": spec.model_dump(mode="json"), "seed": seed, "run_id": run_id}
    engine, sampler, history, elapsed_before = _start(
        spec, out_dir, config, model_cache=model_cache, resume=resume, seed=seed, device=device
    )

    def elapsed() -> float:
        """Wall seconds of the whole run, its segments before a resume included."""
        return elapsed_before + time.monotonic() - started

    while (reason := stop_reason(spec, history, elapsed() * price.on_demand / 3600.0)) is None:
        history.append(record := _iteration(engine, spec, len(history) + 1, items, run_id, sampler))
        save_checkpoint(
            checkpoints,
            record.iteration,
            policy=engine.policy,
            optimizer=engine.optimizer,
            value_head=engine.value_head,
            config=config,
            metadata={"history": [asdict(r) for r in history], "elapsed_seconds": elapsed()},
            keep=keep_checkpoints,
        )
        if on_iteration is not None:
            on_iteration(record)

    policy_dir = _save_final_policy(engine, out_dir / POLICY_DIR)
    cost = CostLine(
        instance_type=price.instance_type,
        price_per_hour=price.on_demand,
        currency=price.currency,
        wall_seconds=elapsed(),
    )
    return ColocatedResult(iterations=history, stop_reason=reason, policy_dir=policy_dir, cost=cost)


def _start(
    spec: RunSpec, out_dir: Path, config: dict, *, model_cache: Path, resume: bool, seed: int, device: str | None
) -> tuple[HybridEngine, VLLMSampler | None, list[IterationRecord], float]:
    """The engine (and vLLM sampler) of a run, fresh and seeded, or restored from `out_dir`'s
    latest checkpoint: with the iterations done and the wall seconds spent before (run_colocated)."""
    latest = latest_checkpoint(out_dir / CHECKPOINTS_DIR)
    if latest is not None and not resume:
        raise ResumeError(
            f"{out_dir} already holds checkpoints ({latest.name}): pass resume, or use an empty directory"
        )
    engine = _build_engine(spec, model_cache, device)
    sampler = None
    if spec.rollout.engine == RolloutEngine.VLLM:
        sampler = VLLMSampler(
            build_vllm_engine(spec, engine.policy, colocated=True), engine, out_dir / VLLM_ADAPTERS_DIR
        )
    # Resumed last, so that nothing drawn during the setup above shifts the restored RNG streams.
    history, elapsed_before = _resume(latest, engine, config) if latest is not None else ([], 0.0)
    if latest is not None and sampler is not None:
        sampler.push()  # vLLM loaded the base weights
    if latest is None:
        _seed_everything(seed)
    # Adaptive KL continues from the coefficient the last iteration ended with.
    engine.kl_controller = kl_controller(spec, history[-1].metrics.get("actor/kl_coef") if history else None)
    return engine, sampler, history, elapsed_before


def _build_engine(spec: RunSpec, model_cache: Path, device: str | None) -> HybridEngine:
    """The spec's policy (with its LoRA adapter, if any), critic and reference model on `device`
    (default: CUDA when there is one), in one hybrid engine."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    policy = load_policy(spec.model, cache_dir=model_cache)
    policy.model.to(dev).eval()
    value_head = build_value_head(spec, policy, model_cache)
    if value_head is not None:
        value_head.to(dev)
    policy = with_adapter(spec, policy)
    return HybridEngine(
        policy, spec.training, value_head=value_head, ref_model=reference_model(spec, policy, model_cache)
    )


def _resume(latest: Path, engine: HybridEngine, config: dict) -> tuple[list[IterationRecord], float]:
    """Load the checkpoint `latest` into `engine` (weights, optimizer, critic, RNG states); returns
    the run's history and its wall seconds so far, and sets `config`'s seed to the run's."""
    state = load_checkpoint(
        latest, policy_or_model=engine.policy, optimizer=engine.optimizer, value_head=engine.value_head
    )
    if state.config is None or _without_goal(state.config["spec"]) != _without_goal(config["spec"]):
        raise ResumeError(
            f"{latest} was written for a different run spec; resume with the spec it was started with "
            f"(only {', '.join(sorted(_GOAL_FIELDS))} may change)"
        )
    config["seed"] = state.config["seed"]
    log.info("resuming after iteration %d from %s", state.step, latest)
    return [IterationRecord(**r) for r in state.metadata["history"]], state.metadata["elapsed_seconds"]


def _save_final_policy(engine: HybridEngine, policy_dir: Path) -> Path:
    """Write the trained policy to `policy_dir` as a plain model directory (a LoRA adapter merged
    in: the run is over, and any run can start from it)."""
    policy = engine.policy
    if is_lora(policy.model):
        policy.model = policy.model.merge_and_unload()
    save_policy(policy, policy_dir)
    return policy_dir


def _without_goal(spec: dict) -> dict:
    return {k: v for k, v in spec.items() if k not in _GOAL_FIELDS}


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too


def _iteration(
    engine: HybridEngine,
    spec: RunSpec,
    iteration: int,
    items: Sequence[PromptItem],
    run_id: str,
    sampler: VLLMSampler | None = None,
) -> IterationRecord:
    """Sample (with `sampler`, or the hybrid engine itself), score and train the batch of
    iteration `iteration` (from 1) of the prompt set `items`."""
    messages = cycled_messages(items, (iteration - 1) * spec.groups_per_batch, spec.groups_per_batch)
    sampling = SamplingParams(
        temperature=spec.sampling.temperature, top_p=spec.sampling.top_p, max_new_tokens=spec.sampling.max_new_tokens
    )
    n = spec.samples_per_prompt
    tokenizer = engine.policy.tokenizer
    prompt_ids = [encode_prompt(tokenizer, m.prompt) for m in messages]
    started = time.monotonic()
    completions: list[Completion] = []
    # Chunks of prompts_per_batch prompts, as a rollout worker takes them: this bounds the
    # KV cache, (chunk x n x sequence) entries, whatever the batch size.
    chunk = spec.rollout.prompts_per_batch
    for start in range(0, len(prompt_ids), chunk):
        completions += (sampler or engine).generate(
            [ids for ids in prompt_ids[start : start + chunk] for _ in range(n)], sampling
        )
    rollout_seconds = time.monotonic() - started

    texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
    rewards = total_rewards(
        spec.reward,
        [
            RewardInput.of(messages[k // n], text, len(c.token_ids))
            for k, (c, text) in enumerate(zip(completions, texts, strict=True))
        ],
    )
    samples = build_samples(
        [
            (m.prompt_id, uuid.uuid5(_GROUP_NAMESPACE, f"{run_id}/{iteration}/{i}").hex, prompt_ids[i])
            for i, m in enumerate(messages)
        ],
        completions,
        rewards,
        run_id=run_id,
        worker_id=WORKER_ID,
        policy_version=iteration - 1,
        reward_source=reward_source(spec.reward),
        generation_seconds=rollout_seconds / len(completions),
    )
    with sampler.training() if sampler is not None else nullcontext():
        metrics = engine.train(samples)
    return IterationRecord(
        iteration=iteration,
        mean_reward=sum(s.reward for s in samples) / len(samples),
        samples=len(samples),
        rollout_seconds=rollout_seconds,
        train_seconds=metrics["perf/seconds"],
        metrics=metrics,
    )
