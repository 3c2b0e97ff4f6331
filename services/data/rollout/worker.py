"""The rollout worker: prompts in, scored samples out.

Delivery (docs/architecture.md): the worker commits a batch's prompt offsets only after that batch's
samples are durably queued, so a worker killed at any point loses no prompt; another member
of the "rollout" group receives the uncommitted prompts once this one's session lapses.

On SIGTERM (a spot interruption notice, or a scale-down) the worker takes no new prompts;
the batch in hand is finished if it can be before the grace deadline, and abandoned
(uncommitted, so redelivered) otherwise.

After each batch the worker adds what it did to its counters in the state store
(``StateStore.report_worker``: samples, generation seconds, reward cache keys by result, and
the most sequences it generated at once, sized from the memory free: ``generation_batch``), which
the API's /metrics exports: one scrape of the API covers every worker, wherever its pod runs.

A reward that fails or times out for a response scores 0.0 for its term (`score_batch`): the
sample is still produced, its reward is not cached, and the failures are counted on the run
(`runs.reward_failures`, `runs.last_reward_error`), with a warning logged once per reason.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from contracts.messages import PromptMessage
from contracts.samples import Sample, encode_group
from contracts.training import AdvantageEstimator
from services.core.errors import PermanentError
from services.data.policy_store import load_version, policy_dir
from services.data.reward.functions import (
    RewardInput,
    close_pools,
    prepare_terms,
    reward_key,
    score_batch,
    terms_fingerprint,
)
from services.data.rollout.dynamic_sampling import informative_groups
from services.data.rollout.generation_batch import GenerationBatch, MemoryProbe, generate_in_chunks
from services.data.rollout.vllm_engine import build_vllm_engine
from services.domain.names import ROLLOUT_GROUP, prompts_topic, samples_topic
from services.domain.reward_spec import RewardTerm
from services.domain.runspec import RunSpec
from services.ports.objects.object_store import ObjectStore
from services.ports.queue.queue import CommitFailedError, Queue, Record, next_offsets
from services.ports.reward_cache.reward_cache import RewardCache, reward_cache_key
from services.ports.state.state_store import StateStore
from trainer_core.engines import make_engine
from trainer_core.engines.hf import Completion, HFEngine, SamplingParams
from trainer_core.engines.vllm import VLLMEngine
from trainer_core.memory import MemoryMonitor
from trainer_core.models.loading import NoChatTemplateError, Policy, encode_prompt, load_policy
from trainer_core.models.lora import is_adapter_dir
from trainer_core.models.placement import spread_over_gpus

log = logging.getLogger(__name__)


def rollout_engine(spec: RunSpec, policy: Policy) -> HFEngine | VLLMEngine:
    """A worker's sampler (`spec.rollout.engine`) over the run's base `policy`: `hf` over the
    policy's own model object, spread over the worker's `rollout.gpus_per_worker` GPUs where it
    has more than one (a no-op on a machine without GPUs), `vllm` loaded from the directory the
    base weights came from, sharded over them. Later versions arrive through `set_model` (hf) or,
    on vLLM, `load_weights_from` (full weights) and `set_lora` (adapters)."""
    if spec.rollout.engine == "hf":
        policy.model = spread_over_gpus(policy.model, spec.rollout.gpus_per_worker)
        return make_engine("hf", model=policy.model, tokenizer=policy.tokenizer)
    return build_vllm_engine(spec, policy)


def serve_version(
    engine: HFEngine | VLLMEngine, policy: Policy, objects: ObjectStore, run_id: str, version: int, model_cache: Path
) -> None:
    """Make ``engine`` sample from the run's policy ``version``. vLLM reads it from a local copy
    (`policy_dir`) itself: adapters swapped per request, full weights reloaded in its engine
    process; hf streams it from the store into the one model ``policy`` holds, shard by shard
    (`load_version`): a new version never costs a second copy."""
    if isinstance(engine, VLLMEngine):
        local = policy_dir(objects, run_id, version, model_cache)
        if is_adapter_dir(local):
            engine.set_lora(local)
        else:
            engine.load_weights_from(local)
    else:
        policy.model = load_version(policy.model, objects, run_id, version, model_cache).eval()
        engine.set_model(policy.model)


def reward_source(terms: Sequence[RewardTerm]) -> str:
    """What scored a sample: "model" when a reward model is among the terms, else "rule"."""
    return "model" if any(t.fn == "reward_model" for t in terms) else "rule"


def build_samples(
    groups: Sequence[tuple[str, str, Sequence[int]]],
    completions: Sequence[Completion],
    rewards: Sequence[float],
    *,
    reward_metrics: Sequence[dict[str, float]] | None = None,
    run_id: str,
    worker_id: str,
    policy_version: int,
    reward_source: str,
    generation_seconds: float,
) -> list[Sample]:
    """Samples of prompts sampled n times each: `groups` holds (prompt_id, group_id, prompt
    token ids) per prompt, and `completions`/`rewards` (and `reward_metrics`, what the reward
    reported beside each score) hold its n completions, prompt by prompt."""
    n = len(completions) // len(groups)
    now = time.time()
    return [
        Sample(
            sample_id=uuid.uuid4().hex,
            run_id=run_id,
            prompt_id=prompt_id,
            group_id=group_id,
            prompt_ids=list(prompt_ids),
            response_ids=list(completions[k].token_ids),
            logprobs=list(completions[k].logprobs),
            reward=rewards[k],
            reward_metrics=reward_metrics[k] or None if reward_metrics else None,
            reward_source=reward_source,
            policy_version=policy_version,
            worker_id=worker_id,
            generation_seconds=generation_seconds,
            created_at=now,
        )
        for i, (prompt_id, group_id, prompt_ids) in enumerate(groups)
        for k in range(i * n, (i + 1) * n)
    ]


class StopSignal:
    """Set by the SIGTERM handler; generation checks ``deadline_passed`` every token step."""

    def __init__(self, grace_s: float) -> None:
        self._event = threading.Event()
        self._grace_s = grace_s
        self._deadline = float("inf")

    def set(self) -> None:
        if not self._event.is_set():
            # Leave a margin for queueing the samples and committing before the SIGKILL.
            self._deadline = time.monotonic() + 0.8 * self._grace_s
            self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``, less when the stop comes; whether it came."""
        return self._event.wait(seconds)

    def deadline_passed(self) -> bool:
        return time.monotonic() > self._deadline


class RolloutWorker:
    def __init__(
        self,
        *,
        run_id: str,
        worker_id: str,
        spec: RunSpec,
        state: StateStore,
        queue: Queue,
        objects: ObjectStore,
        rewards: RewardCache,
        model_cache: Path,
        session_timeout_s: float,
        stop: StopSignal,
    ) -> None:
        self.run_id = run_id
        self.worker_id = worker_id
        self.spec = spec
        self.state = state
        self.queue = queue
        self.objects = objects
        self.rewards = rewards
        self.model_cache = model_cache
        self.session_timeout_s = session_timeout_s
        self.stop = stop
        self.version = -1
        self.engine: HFEngine | VLLMEngine | None = None
        self._policy: Policy | None = None  # the one model this worker samples from
        # How many sequences the engine generates at once, from the memory free (generation_batch).
        self.generation_batch = GenerationBatch()
        self._memory = MemoryProbe(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        # The reward terms as this worker runs them, and what their cached rewards depend on: fixed
        # for the worker's life, as its loaded reward model is (`load_reward_model`), but for a
        # reward server's term, which follows the server wherever it listens (`_reward_ready`).
        self._reward_url: str | None = None
        self._terms = spec.reward_terms(None)
        self._terms_key = terms_fingerprint(self._terms)
        self._reward_errors_logged: set[str] = set()  # each reason is logged once; every failure is counted
        self.sampling = SamplingParams(
            temperature=spec.sampling.temperature,
            top_p=spec.sampling.top_p,
            max_new_tokens=spec.sampling.max_new_tokens,
        )

    def run(self) -> None:
        consumer = self.queue.consumer(
            prompts_topic(self.run_id),
            ROLLOUT_GROUP,
            member_id=self.worker_id,
            session_timeout_s=self.session_timeout_s,
        )
        memory = MemoryMonitor()
        try:
            prepare_terms(self._terms)
            while not self.stop.is_set():
                memory.maybe_log(log)  # a line every 30 s: current and peak memory
                if not self._reward_ready():
                    self.stop.wait(1.0)  # no prompt taken meanwhile: others' are not held up
                    continue
                self._load_latest_policy()
                records = consumer.poll(self.spec.rollout.prompts_per_batch, timeout_s=1.0)
                if not records:
                    continue
                samples = self._generate(records)
                if samples is None:
                    log.info("stop deadline reached mid-batch: %d prompts left uncommitted", len(records))
                    break
                # One record per group (contracts.samples): a kill mid-produce leaves no part of one.
                groups = [list(g) for _, g in itertools.groupby(samples, key=lambda s: s.group_id)]
                if self.spec.training.dynamic_sampling:
                    groups, dropped = informative_groups(samples)
                    samples = [s for g in groups for s in g]
                    if dropped:
                        self.state.count_filtered_samples(self.run_id, dropped)
                if groups:
                    self.queue.produce(
                        samples_topic(self.run_id),
                        [encode_group(g) for g in groups],
                        keys=[g[0].group_id.encode() for g in groups],
                    )
                try:
                    consumer.commit(next_offsets(records))
                except CommitFailedError:
                    # The group rebalanced while we generated: the new owner redoes these prompts.
                    log.warning("prompt commit fenced after a rebalance; %d prompts will be redone", len(records))
                self._report(samples)
        finally:
            consumer.close()
            close_pools()

    def _reward_ready(self) -> bool:
        """Whether the reward terms can run: always, but while the reward server the run asks
        for has not said where it listens. Read again before each batch: a server started again
        (its spot node taken back) listens elsewhere, and the worker follows it."""
        if self.spec.reward_server is None:
            return True
        url = self.state.reward_url(self.run_id)
        if url is None:
            return False
        if url != self._reward_url:
            self._reward_url, self._terms = url, self.spec.reward_terms(url)
            self._terms_key = terms_fingerprint(self._terms)
            log.info("worker %s scoring through the run's reward server at %s", self.worker_id, url)
        return True

    def _report(self, samples: Sequence[Sample]) -> None:
        """Add this batch to the worker's counters in the state store (queued samples count, also
        when a rebalance fenced the commit: they are in the queue)."""
        self.state.report_worker(
            self.run_id,
            self.worker_id,
            samples=len(samples),
            generation_seconds=sum(s.generation_seconds for s in samples),
            reward_cache=self.rewards.requests.take(),
            generation_batch=self.generation_batch.at_once,
        )

    def _load_latest_policy(self) -> None:
        version = self.state.policy_version(self.run_id)
        if version == self.version:
            return
        if self.engine is None:
            self._policy = load_policy(self.spec.model, cache_dir=self.model_cache)
            self._policy.model.eval()
            self.engine = rollout_engine(self.spec, self._policy)
        if version > 0:
            serve_version(self.engine, self._policy, self.objects, self.run_id, version, self.model_cache)
        self.version = version
        log.info("worker %s serving policy v%d", self.worker_id, version)

    def _generate(self, records: Sequence[Record]) -> list[Sample] | None:
        assert self.engine is not None
        n = self.spec.samples_per_prompt
        prompts = [PromptMessage.decode(r.value) for r in records]
        tokenizer = self.engine.tokenizer
        try:
            prompt_ids = [encode_prompt(tokenizer, p.prompt) for p in prompts]
        except NoChatTemplateError as e:
            raise PermanentError(str(e)) from None
        started = time.monotonic()
        completions = generate_in_chunks(
            self.engine,
            [ids for ids in prompt_ids for _ in range(n)],
            self.sampling,
            self.generation_batch,
            self._memory,
            should_stop=self.stop.deadline_passed,
        )
        if completions is None:
            return None
        seconds = (time.monotonic() - started) / len(completions)
        texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        rewards, reward_metrics = self._score(prompts, texts, [len(c.token_ids) for c in completions])
        baselines = None
        if self.spec.training.advantage_estimator == AdvantageEstimator.REMAX:
            baselines = self._greedy_rewards(prompts, prompt_ids)
            if baselines is None:
                return None
        samples = build_samples(
            [(p.prompt_id, uuid.uuid4().hex, ids) for p, ids in zip(prompts, prompt_ids, strict=True)],
            completions,
            rewards,
            reward_metrics=reward_metrics,
            run_id=self.run_id,
            worker_id=self.worker_id,
            policy_version=self.version,
            reward_source=reward_source(self.spec.reward),
            generation_seconds=seconds,
        )
        if baselines is None:
            return samples
        return [dataclasses.replace(s, baseline_reward=baselines[i // n]) for i, s in enumerate(samples)]

    def _greedy_rewards(self, prompts: Sequence[PromptMessage], prompt_ids: Sequence[list[int]]) -> list[float] | None:
        """ReMax's baselines (Li et al. 2023): the reward of one greedy response per prompt, in
        order; None if the stop deadline passed meanwhile."""
        assert self.engine is not None
        greedy = dataclasses.replace(self.sampling, temperature=0.0)
        completions = self.engine.generate(list(prompt_ids), greedy, should_stop=self.stop.deadline_passed)
        if completions is None:
            return None
        texts = self.engine.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        return self._score(prompts, texts, [len(c.token_ids) for c in completions], per_prompt=1)[0]

    def _score(
        self,
        prompts: Sequence[PromptMessage],
        texts: Sequence[str],
        lengths: Sequence[int],
        per_prompt: int | None = None,
    ) -> tuple[list[float], list[dict[str, float]]]:
        """Rewards, and what the reward reported beside each, through the shared cache of
        `per_prompt` (default samples_per_prompt) texts per prompt: the same response to the same
        prompt is scored once (a cached reward keeps its score, not its figures). A reward that
        failed is not cached (the failure may be transient) and is counted on the run."""
        n = per_prompt or self.spec.samples_per_prompt
        inputs = [RewardInput.of(prompts[k // n], texts[k], lengths[k]) for k in range(len(texts))]
        keys = [reward_cache_key(self._terms_key, reward_key(i)) for i in inputs]
        cached = self.rewards.get_many(keys)
        missing = [k for k, key in enumerate(keys) if key not in cached]
        # One call for the batch: a reward model or function term scores all the missing responses together.
        scores = score_batch(self._terms, [inputs[k] for k in missing])
        if scores.failures:
            self._report_reward_failures(scores.failures, scores.reason or "unknown")
        fresh = dict(zip(missing, scores.totals, strict=True))
        figures = dict(zip(missing, scores.metrics, strict=True))
        cacheable = {keys[k]: fresh[k] for k, failed in zip(missing, scores.failed, strict=True) if not failed}
        if cacheable:
            self.rewards.put_many(cacheable)
        rewards = [cached[key] if key in cached else fresh[k] for k, key in enumerate(keys)]
        return rewards, [figures.get(k, {}) for k in range(len(keys))]

    def _report_reward_failures(self, by_reason: Mapping[str, int], reason: str) -> None:
        self.state.count_reward_failures(self.run_id, by_reason, reason)
        if reason not in self._reward_errors_logged:
            self._reward_errors_logged.add(reason)
            log.warning(
                "run %s: a reward failed, scoring 0.0 (logged once per reason, each counted on the run): %s",
                self.run_id,
                reason,
            )
