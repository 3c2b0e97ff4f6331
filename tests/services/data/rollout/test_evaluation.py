"""The eval pod's work in process (tiny model): a published version scored on the held-out set
with the run's reward terms, the result written last, and a retried pod finding it done."""

from __future__ import annotations

from pathlib import Path

from contracts.evaluation import EvalResult
from services.core.config import Settings
from services.data.policy_store import publish_policy
from services.data.rollout.evaluation import run_eval_job
from services.domain.names import eval_prompts_key, eval_result_key
from services.domain.prompt_items import PromptItem
from services.domain.prompts import to_jsonl
from services.domain.runspec import RunSpec
from services.ports.wiring import open_backends
from trainer_core.models.loading import load_policy

RUN = "run-eval"
HELD_OUT = [PromptItem(prompt=f"{a}+{a}=", answer=str(2 * a)) for a in range(3)]


def test_a_published_version_is_scored_on_the_held_out_set_once(tmp_path: Path) -> None:
    spec = RunSpec.model_validate(
        {
            "model": "tiny",
            "prompts": [{"prompt": "x"}],
            "batch_samples": 8,
            "iterations": 1,
            "reward": [
                {"fn": "regex", "pattern": "[\\s\\S]*", "weight": 0.5}
            ],  # every response scores 0.5: above 0, a pass
            "rollout": {"prompts_per_batch": 2},  # two generate calls for the three prompts
            "eval": {"prompts": "inline", "samples_per_prompt": 2, "max_new_tokens": 3, "metrics": ["mean", "pass@2"]},
        }
    )
    settings = Settings(home=tmp_path, model_cache=tmp_path / "models")
    b = open_backends(settings)
    try:
        b.objects.put_bytes(eval_prompts_key(RUN), to_jsonl(HELD_OUT))  # as the API stores it
        publish_policy(b.objects, RUN, 1, load_policy("tiny", cache_dir=settings.resolved_model_cache()), tmp_path)
        result = run_eval_job(
            run_id=RUN,
            version=1,
            spec=spec,
            terms=spec.reward,
            objects=b.objects,
            model_cache=settings.resolved_model_cache(),
        )
        assert (result.policy_version, result.prompts, result.samples, result.reward_failures) == (1, 3, 6, 0)
        assert result.metrics == {"mean": 0.5, "pass@2": 1.0} and result.mean_score == 0.5
        assert EvalResult.from_json(b.objects.get_bytes(eval_result_key(RUN, 1))) == result

        b.objects.delete_prefix(eval_prompts_key(RUN))  # a retried pod reads nothing: the result is there already
        assert (
            run_eval_job(
                run_id=RUN,
                version=1,
                spec=spec,
                terms=spec.reward,
                objects=b.objects,
                model_cache=settings.resolved_model_cache(),
            )
            == result
        )
    finally:
        b.close()
