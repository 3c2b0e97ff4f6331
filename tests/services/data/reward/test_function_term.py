"""The `function` reward term: a user's verl-style reward file run by the scorer's own pool of
worker processes (`path`), or by a reward service (`url`), through `score_batch` as a run scores."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.core.errors import PermanentError
from services.data.reward.function_pool import FunctionPool
from services.data.reward.functions import RewardInput, close_pools, prepare_terms, score_batch, terms_fingerprint
from services.data.reward.service import create_reward_app
from services.data.reward.user_function import resolve
from services.domain.reward_spec import RewardTerm
from tests.services.data.reward.reward_servers import serve
from tests.services.data.reward.user_rewards import DICT, GSM8K, HOSTILE, write


def inputs(*rows: tuple[str, str, object]) -> list[RewardInput]:
    """(data_source, response, ground truth) each."""
    return [
        RewardInput("q", response, 1, truth, source, {"index": k}) for k, (source, response, truth) in enumerate(rows)
    ]


@pytest.fixture
def rewards_dir(tmp_path: Path) -> Path:
    write(tmp_path, "gsm8k.py", GSM8K)
    write(tmp_path, "dict.py", DICT)
    write(tmp_path, "hostile.py", HOSTILE)
    return tmp_path


@pytest.fixture(autouse=True)
def fresh_pools() -> Iterator[None]:
    yield
    close_pools()


def test_a_verl_reward_file_scores_unchanged_its_dict_figures_reported(rewards_dir: Path) -> None:
    terms = [
        RewardTerm(fn="function", path=f"{rewards_dir}/gsm8k.py:compute_score"),
        RewardTerm(fn="function", path=f"{rewards_dir}/dict.py:compute_score", weight=0.5),
    ]
    prepare_terms(terms)

    scores = score_batch(terms, inputs(("openai/gsm8k", "so #### 42", "42"), ("openai/gsm8k", "so #### 41", "42")))

    # gsm8k: 1 then 0; dict: "so #### 42" != "42" so -1.0 each, weighted 0.5
    assert scores.totals == [0.5, -0.5]
    assert scores.metrics == [{"acc": 0.0, "format": 1.0}, {"acc": 0.0, "format": 1.0}]  # finite numbers only
    assert not scores.failures


def test_a_misbehaving_function_scores_0_counted_by_reason_and_the_rest_still_score(rewards_dir: Path) -> None:
    term = RewardTerm(fn="function", path=f"{rewards_dir}/hostile.py:compute_score")
    scores = score_batch(
        [term],
        inputs(
            ("ok", "42", "42"), ("raise", "42", "42"), ("exit", "42", "42"), ("nan", "42", "42"), ("ok", "41", "42")
        ),
    )
    assert scores.totals == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert scores.failed == [False, True, True, True, False]
    assert scores.failures == {"function:exception": 1, "function:crash": 1, "function:invalid": 1}
    assert "SECRET-USER-TEXT" not in (scores.reason or "")


def test_the_same_file_served_by_a_reward_service_scores_alike(rewards_dir: Path) -> None:
    pool = FunctionPool(resolve(f"{rewards_dir}/hostile.py:compute_score"), workers=1, timeout_s=5.0)
    for url in serve(create_reward_app(pool=pool)):
        term = RewardTerm(fn="function", url=url)
        scores = score_batch([term], inputs(("ok", "42", "42"), ("raise", "42", "42"), ("ok", "[1, 2]", [1, 2])))
        assert scores.totals == [1.0, 0.0, 1.0]
        assert scores.failures == {"function:exception": 1}
        # The cache keys by the file's content: served or run in the worker, the same reward.
        assert terms_fingerprint([term]) == terms_fingerprint(
            [RewardTerm(fn="function", path=f"{rewards_dir}/hostile.py:compute_score")]
        )
        assert resolve(f"{rewards_dir}/hostile.py:compute_score").fingerprint in terms_fingerprint([term])
    down = score_batch([RewardTerm(fn="function", url=url)], inputs(("ok", "42", "42")))
    assert down.failures == {"function:unavailable": 1}


def test_an_edited_reward_file_changes_the_cache_fingerprint(rewards_dir: Path) -> None:
    term = RewardTerm(fn="function", path=f"{rewards_dir}/gsm8k.py:compute_score")
    before = terms_fingerprint([term])
    (rewards_dir / "gsm8k.py").write_text(GSM8K.replace("return score", "return 2 * score"))
    assert terms_fingerprint([term]) != before


@pytest.mark.parametrize(
    ("source", "said"),
    [
        ("import no_such_module_anywhere\n", "does not import"),
        ("def other():\n    return 1\n", "no `compute_score`"),
        ("def compute_score(a):\n    return 1\n", "should take"),
    ],
)
def test_a_reward_that_cannot_be_served_fails_the_run_at_once_without_its_text(
    tmp_path: Path, source: str, said: str
) -> None:
    write(tmp_path, "bad.py", source + "# SECRET-USER-TEXT\n")
    with pytest.raises(PermanentError, match=said) as info:
        prepare_terms([RewardTerm(fn="function", path=f"{tmp_path}/bad.py:compute_score")])
    assert "SECRET-USER-TEXT" not in str(info.value)
