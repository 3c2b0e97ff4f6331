"""A prompt item as verl's datasets hold one (chat messages, any JSON ground truth, data_source,
extra_info), bounded, and as it travels to the rollout workers."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from contracts.messages import PromptMessage, answer_text, prompt_text
from services.domain.prompt_items import MAX_REWARD_DATA_CHARS, PromptItem, cycled_messages
from services.domain.reward_spec import RewardTerm

VERL_ROW = {
    "prompt": [{"role": "system", "content": "Think step by step."}, {"role": "user", "content": "What is 2 + 3?"}],
    "answer": "5",
    "data_source": "openai/gsm8k",
    "extra_info": {"split": "train", "index": 7, "ability": "math"},
}


def test_a_chat_item_reaches_the_workers_whole() -> None:
    item = PromptItem.model_validate(VERL_ROW)
    message = PromptMessage.decode(item.message("7").encode())
    assert message == PromptMessage("7", VERL_ROW["prompt"], "5", "openai/gsm8k", VERL_ROW["extra_info"])
    assert prompt_text(message.prompt) == "Think step by step.\n\nWhat is 2 + 3?"


def test_a_ground_truth_may_be_any_json_value() -> None:
    tests = {"inputs": ["1 2\n"], "outputs": ["3\n"]}
    item = PromptItem(prompt="Add two numbers read from stdin.", answer=tests)
    assert PromptMessage.decode(item.message("0").encode()).answer == tests
    assert answer_text(tests) == '{"inputs": ["1 2\\n"], "outputs": ["3\\n"]}'
    assert answer_text("5") == "5" and answer_text(None) is None


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [{"role": "narrator", "content": "x"}]}, "prompt"),
        ({"prompt": [{"role": "user"}]}, "prompt"),
        ({"prompt": [{"role": "user", "content": "x" * 60_000}] * 2}, "prompt"),
        ({"prompt": "x", "extra_info": {"blob": "y" * MAX_REWARD_DATA_CHARS}}, "extra_info"),
        ({"prompt": "x", "answer": ["y" * MAX_REWARD_DATA_CHARS]}, "answer"),
        ({"prompt": "x", "extra_info": ["not", "an", "object"]}, "extra_info"),
        ({"prompt": "x", "reward_model": {"ground_truth": "5"}}, "reward_model"),
    ],
)
def test_a_bad_item_is_refused_naming_the_field_not_the_content(row: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        PromptItem.model_validate(row)
    errors = info.value.errors(include_input=False)
    assert errors[0]["loc"][0] == field
    assert "y" * 100 not in str(errors)


def test_a_function_reward_names_a_python_file_and_function_or_a_service() -> None:
    assert RewardTerm(fn="function", path="/data/rewards/gsm8k.py:compute_score").path.endswith(":compute_score")
    assert RewardTerm(fn="function", url="http://rewards:8080").url
    for bad in (
        {},
        {"path": "/data/rewards/gsm8k.py"},
        {"path": "/data/rewards/gsm8k.py:1st"},
        {"path": "/data/r.py:f", "url": "http://rewards:8080"},
    ):
        with pytest.raises(ValidationError, match="function reward"):
            RewardTerm(fn="function", **bad)


def test_a_format_pattern_is_checked_as_a_regex_is() -> None:
    assert RewardTerm(fn="format").pattern is None
    with pytest.raises(ValidationError):
        RewardTerm(fn="format", pattern="(a")


def test_a_reward_server_serves_exactly_one_term_with_a_path_and_the_rest_stay_in_the_workers() -> None:
    from services.domain.runspec import RunSpec

    base = {"model": "tiny", "prompts": [{"prompt": "x"}], "iterations": 1, "batch_samples": 4, "reward_server": {}}
    spec = RunSpec.model_validate({**base, "reward": [{"fn": "math"}, {"fn": "function", "path": "/d/r.py:score"}]})
    assert spec.reward_server.instance_type == "g4dn.xlarge" and spec.served_term() == 1
    assert spec.reward_terms(None) == spec.reward  # no address yet: as written
    served = spec.reward_terms("http://10.0.0.7:8100")
    assert (served[1].path, served[1].url, served[0]) == (None, "http://10.0.0.7:8100", spec.reward[0])
    for reward in (
        [{"fn": "math"}],
        [{"fn": "function", "path": "/d/a.py:f"}, {"fn": "reward_model", "path": "/d/rm"}],
    ):
        with pytest.raises(ValidationError, match="reward_server serves one reward term with a `path`"):
            RunSpec.model_validate({**base, "reward": reward})
    with pytest.raises(ValidationError, match="instance_type"):
        RunSpec.model_validate(
            {**base, "reward": [{"fn": "function", "path": "/d/r.py:f"}], "reward_server": {"instance_type": "t9.huge"}}
        )


def test_a_run_cycles_over_its_prompt_set_keeping_each_prompt_id() -> None:
    items = [PromptItem(prompt=f"{i}+1", answer=str(i + 1)) for i in range(3)]
    messages = cycled_messages(items, 2, 5)  # the last of epoch 1, all of epoch 2, the first of epoch 3
    assert [(m.prompt_id, m.prompt) for m in messages] == [
        ("2", "2+1"),
        ("0", "0+1"),
        ("1", "1+1"),
        ("2", "2+1"),
        ("0", "0+1"),
    ]
