"""The `reward_model` reward term: a saved reward model scores (prompt, response) in a run."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from contracts.messages import PromptMessage
from services.data.reward.functions import REWARD_FUNCTIONS, RewardInput, load_reward_model, total_rewards
from services.data.rollout.worker import RolloutWorker, StopSignal
from services.domain.reward_spec import RewardTerm
from services.domain.runspec import RunSpec
from services.ports.reward_cache.sqlite_reward_cache import InProcessRewardCache
from tests.services.data.reward.reward_servers import serve, train_reward_model
from trainer_core.supervised.reward_model import RewardModel


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_reward_model(tmp_path_factory.mktemp("rm"), tmp_path_factory.getbasetemp() / "models")


def test_reward_model_term_scores_with_the_saved_model(rm_dir: Path) -> None:
    term = RewardTerm(fn="reward_model", path=str(rm_dir))
    inputs = [RewardInput("cat?", "dog yes", 2, None), RewardInput("cat?", "dog no", 2, None)]

    got = total_rewards([term], inputs)

    want = RewardModel.load(rm_dir).score(["cat?", "cat?"], ["dog yes", "dog no"])
    assert got == pytest.approx(want, abs=1e-6)
    assert got[0] > got[1]
    assert load_reward_model(str(rm_dir)) is load_reward_model(str(rm_dir))  # loaded once per process


def test_weights_combine_model_and_rule_terms(rm_dir: Path) -> None:
    terms = [
        RewardTerm(fn="reward_model", path=str(rm_dir), weight=0.5),
        RewardTerm(fn="regex", pattern="yes", weight=2.0),
        RewardTerm(fn="length_penalty", target_tokens=4, weight=1.0),
    ]
    inputs = [RewardInput("sun?", "red yes", 7, None), RewardInput("sun?", "red no", 6, None)]
    rm_scores = RewardModel.load(rm_dir).score(["sun?", "sun?"], ["red yes", "red no"])

    got = total_rewards(terms, inputs)

    # length_penalty: -(7 - 4) / 4 and -(6 - 4) / 4
    assert got == pytest.approx([0.5 * rm_scores[0] + 2.0 - 0.75, 0.5 * rm_scores[1] - 0.5], abs=1e-6)
    assert total_rewards(terms, inputs[:1]) == pytest.approx(got[:1], abs=1e-6)
    assert total_rewards(terms, []) == []


def test_reward_term_needs_a_path_and_the_server_checks_what_is_there(rm_dir: Path, tmp_path: Path, settings) -> None:
    from services.control.api.service import SpecFieldError, check_spec_for_server

    assert RewardTerm(fn="reward_model", path=str(rm_dir)).path == str(rm_dir)
    with pytest.raises(ValidationError, match="needs `path`"):
        RewardTerm(fn="reward_model")

    def spec(path: Path) -> RunSpec:
        reward = [{"fn": "reward_model", "path": str(path)}]
        return RunSpec.model_validate(
            {"model": "tiny", "prompts": [{"prompt": "cat?"}], "iterations": 1, "batch_samples": 4, "reward": reward}
        )

    # The spec checks the form only: a stored spec reads back even if the directory has gone.
    gone = spec(tmp_path / "gone")
    assert RunSpec.from_stored(gone.model_dump(mode="json")).reward[0].path == str(tmp_path / "gone")
    # The server checks the directory, inside the directories it allows.
    allowing = settings.model_copy(update={"data_dirs": os.pathsep.join([str(tmp_path), str(rm_dir.parent)])})
    check_spec_for_server(spec(rm_dir), allowing)
    with pytest.raises(SpecFieldError, match="no reward model saved by `spotrl train-rm` there"):
        check_spec_for_server(gone, allowing)
    with pytest.raises(SpecFieldError, match="SPOTRL_DATA_DIRS"):
        check_spec_for_server(spec(rm_dir), settings.model_copy(update={"data_dirs": str(tmp_path)}))


def test_rollout_worker_scores_a_batch_through_the_cache(
    rm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = RunSpec(
        model="tiny",
        prompts=[{"prompt": "cat?"}],
        iterations=1,
        samples_per_prompt=2,
        batch_samples=4,
        reward=[RewardTerm(fn="reward_model", path=str(rm_dir)), RewardTerm(fn="regex", pattern="yes", weight=0.25)],
    )
    cache = InProcessRewardCache()
    worker = RolloutWorker(
        run_id="run-1",
        worker_id="w0",
        spec=spec,
        state=None,  # the scoring path touches only the spec and the reward cache
        queue=None,
        objects=None,
        rewards=cache,
        model_cache=tmp_path,
        session_timeout_s=1.0,
        stop=StopSignal(1.0),
    )
    prompts = [PromptMessage("p0", "cat?", None), PromptMessage("p1", "dog?", None)]
    texts = ["sun yes", "sun no", "red yes", "red no"]  # samples_per_prompt = 2 per prompt

    rewards, _ = worker._score(prompts, texts, [7, 6, 7, 6])

    rm_scores = RewardModel.load(rm_dir).score(["cat?", "cat?", "dog?", "dog?"], texts)
    assert rewards == pytest.approx([s + 0.25 * ("yes" in t) for s, t in zip(rm_scores, texts, strict=True)], abs=1e-6)
    # Scored once: the second time every reward comes from the cache, without the model.
    monkeypatch.setitem(REWARD_FUNCTIONS, "reward_model", lambda term, inputs: pytest.fail("scored again"))
    assert worker._score(prompts, texts, [7, 6, 7, 6])[0] == rewards


def test_the_cache_fingerprint_changes_when_the_reward_model_is_retrained(tmp_path: Path) -> None:
    from services.data.reward.functions import terms_fingerprint

    (tmp_path / "head.safetensors").write_bytes(b"v1")
    terms = [
        RewardTerm.model_construct(fn="reward_model", weight=1.0, pattern=None, target_tokens=None, path=str(tmp_path))
    ]
    before = terms_fingerprint(terms)
    assert terms_fingerprint(terms) == before
    (tmp_path / "head.safetensors").write_bytes(b"v2 retrained")
    assert terms_fingerprint(terms) != before


@pytest.fixture(scope="module")
def reward_service(rm_dir: Path) -> Iterator[str]:
    """`spotrl reward-server`'s app on a free loopback port, serving the reward model of `rm_dir`."""
    from services.data.reward.service import create_reward_app

    yield from serve(create_reward_app(rm_dir))


def test_the_reward_service_scores_as_the_model_does(rm_dir: Path, reward_service: str) -> None:
    import httpx

    from services.data.reward.service import MAX_ITEMS, model_fingerprint

    prompts, responses = ["cat?", "dog?", "sun?"], ["red yes", "red no", "tree yes"]
    term = RewardTerm(fn="reward_model", url=reward_service)
    inputs = [RewardInput(p, r, 2, None) for p, r in zip(prompts, responses, strict=True)]
    remote = REWARD_FUNCTIONS["reward_model"](term, inputs)
    assert remote == pytest.approx(RewardModel.load(rm_dir).score(prompts, responses), abs=1e-6)
    health = httpx.get(f"{reward_service}/healthz").json()
    assert health == {"status": "ok", "fingerprint": model_fingerprint(rm_dir)}
    too_many = {"items": [{"prompt": "p", "response": "r"}] * (MAX_ITEMS + 1)}
    assert httpx.post(f"{reward_service}/v1/score", json=too_many).status_code == 422


def test_a_run_names_a_reward_service_the_operator_allows(reward_service: str, settings) -> None:
    from services.control.api.service import SpecFieldError, check_spec_for_server

    with pytest.raises(ValidationError, match="one of the two"):
        RewardTerm(fn="reward_model", path="/rm", url=reward_service)
    spec = RunSpec.model_validate(
        {
            "model": "tiny",
            "prompts": [{"prompt": "cat?"}],
            "iterations": 1,
            "batch_samples": 4,
            "reward": [{"fn": "reward_model", "url": reward_service}],
        }
    )
    with pytest.raises(SpecFieldError, match="SPOTRL_REWARD_SERVICE_URLS"):
        check_spec_for_server(spec, settings)
    check_spec_for_server(spec, settings.model_copy(update={"reward_service_urls": reward_service}))


def test_the_cache_fingerprint_of_a_service_is_its_models(rm_dir: Path, reward_service: str) -> None:
    from services.data.reward.functions import terms_fingerprint
    from services.data.reward.service import model_fingerprint

    described = json.loads(terms_fingerprint([RewardTerm(fn="reward_model", url=reward_service)]))
    assert described[0]["files"] == model_fingerprint(rm_dir)
    gone = json.loads(terms_fingerprint([RewardTerm(fn="reward_model", url="http://127.0.0.1:9/")]))
    assert gone[0]["files"] is None  # nobody answers: the term fails on every batch, and is reported there
