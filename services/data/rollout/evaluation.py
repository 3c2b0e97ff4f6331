"""The eval pod (``spotrl eval-job RUN VERSION``): policy version VERSION of a run scored on the
run's held-out prompts, the result written to the object store for the scheduler to record.

It loads the version as a rollout worker does (the base model, then the published version's
weights or adapter into it: ``services.data.policy_store``), with the worker's engine
(``rollout.engine``); generates ``eval.samples_per_prompt`` responses per held-out prompt at the
eval's temperature and length, a batch of ``rollout.prompts_per_batch`` prompts at a time, seeded
by the batch's place so that a rerun draws the same responses; scores them with the run's reward
terms (``score_batch``, the worker's call, without its cache: held-out prompts are each scored
once); and writes ``EvalResult`` (mean score, the spec's ``pass@k``, counts, seconds) last, at
``eval_result_key``. A pod that finds that result already written exits at once.

What it does not do: train, queue, or touch the run's state; a failure is its exit code, which
the scheduler counts and retries (``services.control.scheduler.plan``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

from contracts.evaluation import EvalResult
from services.data.reward.functions import RewardInput, close_pools, prepare_terms, score_batch
from services.data.rollout.eval_metrics import eval_metrics
from services.data.rollout.worker import rollout_engine, serve_version
from services.domain.names import eval_prompts_key, eval_result_key
from services.domain.prompt_items import PromptItem
from services.domain.prompts import parse_jsonl
from services.domain.reward_spec import RewardTerm
from services.domain.runspec import RunSpec
from services.ports.objects.object_store import ObjectStore
from trainer_core.engines.hf import HFEngine, SamplingParams
from trainer_core.engines.vllm import VLLMEngine
from trainer_core.models.loading import encode_prompt, load_policy

log = logging.getLogger(__name__)


def run_eval_job(
    *, run_id: str, version: int, spec: RunSpec, terms: Sequence[RewardTerm], objects: ObjectStore, model_cache: Path
) -> EvalResult:
    """Evaluate policy ``version`` of ``run_id`` on its held-out prompts, scored with the reward
    ``terms`` (the spec's, its reward server's at its address: ``RunSpec.reward_terms``); returns
    the result written."""
    if spec.eval is None:
        raise ValueError(f"run {run_id} has no eval section")
    key = eval_result_key(run_id, version)
    if objects.exists(key):  # a retried pod whose predecessor wrote its result
        log.info("the eval of policy v%d is written already; nothing to do", version)
        return EvalResult.from_json(objects.get_bytes(key))
    started = time.monotonic()
    items = parse_jsonl(objects.get_bytes(eval_prompts_key(run_id)), "the run's stored held-out prompt set")
    engine = _engine_serving(spec, objects, run_id, version, model_cache)
    sampling = SamplingParams(
        temperature=spec.eval.temperature, top_p=spec.sampling.top_p, max_new_tokens=spec.eval.max_new_tokens
    )
    n = spec.eval.samples_per_prompt
    prepare_terms(terms)  # a reward that cannot load fails the pod with the reason, not every score
    try:
        scores, failures = _scored(engine, items, terms, sampling, n, spec.rollout.prompts_per_batch, version)
    finally:
        close_pools()
    metrics = eval_metrics(scores, spec.eval.metrics)
    result = EvalResult(
        policy_version=version,
        mean_score=metrics["mean"],
        metrics=metrics,
        prompts=len(items),
        samples=len(items) * n,
        reward_failures=failures,
        seconds=time.monotonic() - started,
        ended_at=time.time(),
    )
    objects.put_bytes(key, result.to_json())
    log.info("eval of policy v%d: %s", version, ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return result


def _engine_serving(
    spec: RunSpec, objects: ObjectStore, run_id: str, version: int, model_cache: Path
) -> HFEngine | VLLMEngine:
    """The run's sampler (``rollout.engine``) serving policy ``version`` (0: the base model), loaded
    as a rollout worker loads a new version: into the base model, no second copy."""
    policy = load_policy(spec.model, cache_dir=model_cache)
    policy.model.eval()
    engine = rollout_engine(spec, policy)
    if version == 0:
        return engine
    serve_version(engine, policy, objects, run_id, version, model_cache)
    return engine


def _scored(
    engine: HFEngine | VLLMEngine,
    items: Sequence[PromptItem],
    terms: Sequence[RewardTerm],
    sampling: SamplingParams,
    n: int,
    step: int,
    version: int,
) -> tuple[list[list[float]], int]:
    """Each held-out prompt's ``n`` scores, generated and scored ``step`` prompts at a time, and
    the reward computations that failed."""
    scores: list[list[float]] = []
    failures = 0
    for start in range(0, len(items), step):
        messages = [item.message(str(start + i)) for i, item in enumerate(items[start : start + step])]
        prompt_ids = [encode_prompt(engine.tokenizer, m.prompt) for m in messages]
        completions = engine.generate([ids for ids in prompt_ids for _ in range(n)], sampling, seed=start)
        assert completions is not None  # never stopped: a SIGTERM ends the pod, and the scheduler retries it
        texts = engine.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        scored = score_batch(
            terms, [RewardInput.of(messages[k // n], texts[k], len(c.token_ids)) for k, c in enumerate(completions)]
        )
        failures += sum(scored.failures.values())
        scores += [scored.totals[i * n : (i + 1) * n] for i in range(len(messages))]
        log.info("eval of policy v%d: %d of %d prompts scored", version, len(scores), len(items))
    return scores, failures
