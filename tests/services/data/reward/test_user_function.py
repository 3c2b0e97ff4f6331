"""A user's reward function: its reference, its fingerprint, its signature, and what it returns.

These load benign files in the test process; the hostile ones run in the pool's workers
(test_function_pool.py)."""

from __future__ import annotations

import hashlib
import math
import uuid
from pathlib import Path

import pytest

from services.data.reward.user_function import (
    Failure,
    Item,
    Outcome,
    UserFunctionError,
    call,
    call_style,
    load,
    outcome,
    resolve,
)
from tests.services.data.reward.user_rewards import BATCHED, DICT, GSM8K, write


def score(reference: str, items: list[Item], batched: bool | None = None) -> list[Outcome]:
    function = resolve(reference, batched)
    fn = load(function)
    return call(fn, call_style(fn, function), items)


def test_a_verl_gsm8k_reward_file_scores_unchanged(tmp_path: Path) -> None:
    path = write(tmp_path, "gsm8k.py", GSM8K)
    items = [
        Item("so 6 * 7 = 42\n#### 42", "42", "openai/gsm8k"),
        Item("#### 41", "42"),
        Item("it is 42", "42"),
        Item("#### 1,000", "1000"),
    ]

    outcomes = score(str(path), items)  # the name defaults to compute_score

    assert outcomes == [Outcome(1.0), Outcome(0.0), Outcome(0.0), Outcome(1.0)]
    function = resolve(f"{path}:compute_score")
    assert call_style(load(function), function).batched is False


def test_a_function_is_batched_by_its_parameter_names(tmp_path: Path) -> None:
    path = write(tmp_path, "batch.py", BATCHED)
    function = resolve(f"{path}:compute_score")
    fn = load(function)
    style = call_style(fn, function)
    assert style.batched and style.by_keyword

    outcomes = call(fn, style, [Item("a", "a"), Item("b", "c"), Item("d", "d")])

    assert [o.score for o in outcomes] == [1.0, 0.0, 1.0]
    assert {o.metrics["n"] for o in outcomes if o.metrics} == {3.0}  # one call for the three
    assert call(fn, style, [Item("a", "a", "raise")]) == [Outcome.failed(Failure.EXCEPTION)]
    assert call(fn, style, [Item("a", "a", "short"), Item("b", "b")]) == [Outcome.failed(Failure.INVALID)] * 2


def test_a_dict_result_keeps_its_finite_numbers_as_metrics(tmp_path: Path) -> None:
    path = write(tmp_path, "with_metrics.py", DICT)
    assert score(f"{path}:compute_score", [Item("42", "42"), Item("41", "42")]) == [
        Outcome(2.0, {"acc": 1.0, "format": 1.0}),
        Outcome(-1.0, {"acc": 0.0, "format": 1.0}),
    ]


def test_other_parameter_names_are_called_positionally_and_batched_on_request(tmp_path: Path) -> None:
    source = "def my_reward(src, text, truth, info):\n    return float(text == truth) if not isinstance(text, list) else [float(t == g) for t, g in zip(text, truth)]\n"
    path = write(tmp_path, "positional.py", source)

    assert score(f"{path}:my_reward", [Item("x", "x"), Item("x", "y")]) == [Outcome(1.0), Outcome(0.0)]
    function = resolve(f"{path}:my_reward", batched=True)
    fn = load(function)
    assert call_style(fn, function).batched
    assert call(fn, call_style(fn, function), [Item("x", "x"), Item("x", "y")]) == [Outcome(1.0), Outcome(0.0)]


def test_an_async_function_and_one_without_extra_info(tmp_path: Path) -> None:
    source = (
        "async def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.5\n"
        "def three(data_source, solution_str, ground_truth):\n    return 0.25\n"
    )
    path = write(tmp_path, "forms.py", source)
    assert score(f"{path}:compute_score", [Item("x")]) == [Outcome(0.5)]
    assert score(f"{path}:three", [Item("x")]) == [Outcome(0.25)]


def test_extra_info_reaches_the_function_as_verl_passes_it(tmp_path: Path) -> None:
    source = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return {'score': extra_info.get('index', -1), 'turns': extra_info['num_turns'] is None}\n"
    path = write(tmp_path, "extra.py", source)
    assert score(str(path), [Item("x", extra_info={"index": 7}), Item("x")]) == [
        Outcome(7.0, {"turns": 1.0}),
        Outcome(-1.0, {"turns": 1.0}),
    ]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, Outcome(1.0)),
        (True, Outcome(1.0)),
        (-0.5, Outcome(-0.5)),
        ({"score": 3, "acc": 1.0, "pred": "42", 5: 1.0}, Outcome(3.0, {"acc": 1.0})),
        (float("nan"), Outcome.failed(Failure.INVALID)),
        (-math.inf, Outcome.failed(Failure.INVALID)),
        ("1.0", Outcome.failed(Failure.INVALID)),
        (None, Outcome.failed(Failure.INVALID)),
        ([1.0], Outcome.failed(Failure.INVALID)),
        ({"acc": 1.0}, Outcome.failed(Failure.INVALID)),
        ({"score": float("nan")}, Outcome.failed(Failure.INVALID)),
        ({"score": "1"}, Outcome.failed(Failure.INVALID)),
    ],
)
def test_outcome_of_a_returned_value(value: object, expected: Outcome) -> None:
    assert outcome(value) == expected


def test_the_fingerprint_is_the_files_sha256_and_changes_with_an_edit(tmp_path: Path) -> None:
    path = write(tmp_path, "gsm8k.py", GSM8K)
    before = resolve(f"{path}:compute_score")
    assert before.fingerprint == hashlib.sha256(GSM8K.encode()).hexdigest() + ":compute_score"
    assert resolve(f"{path}:extract_solution").fingerprint != before.fingerprint  # another function, other scores

    path.write_text(GSM8K.replace("return score", "return 0.5 * score"))
    after = resolve(f"{path}:compute_score")

    assert after.fingerprint != before.fingerprint
    # What was fingerprinted is what runs: the old reference still scores with the old code.
    item = [Item("#### 42", "42")]
    fn = load(before)
    assert call(fn, call_style(fn, before), item) == [Outcome(1.0)]
    assert score(f"{path}:compute_score", item) == [Outcome(0.5)]


def test_a_package_module_is_fingerprinted_without_importing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = f"rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / package).mkdir()
    marker = tmp_path / "imported"
    write(tmp_path / package, "__init__.py", f"open({str(marker)!r}, 'w').close()\nfrom .gsm8k import compute_score\n")
    write(tmp_path / package, "gsm8k.py", GSM8K)
    monkeypatch.syspath_prepend(str(tmp_path))

    module = resolve(f"{package}.gsm8k:compute_score")
    whole = resolve(f"{package}:compute_score")

    assert not marker.exists()
    assert module.fingerprint == hashlib.sha256(GSM8K.encode()).hexdigest() + ":compute_score"
    (tmp_path / package / "util.py").write_text("X = 1\n")
    assert resolve(f"{package}:compute_score").fingerprint != whole.fingerprint  # any file of the package
    assert resolve(f"{package}.gsm8k:compute_score").fingerprint == module.fingerprint
    assert score(f"{package}:compute_score", [Item("#### 3", "3")]) == [Outcome(1.0)]
    assert marker.exists()

    (tmp_path / package / "gsm8k.py").write_text(GSM8K + "\n# edited\n")
    with pytest.raises(UserFunctionError, match="changed since it was fingerprinted: restart"):
        load(module)


@pytest.mark.parametrize(
    ("source", "reference", "message"),
    [
        (
            "raise RuntimeError('SECRET-USER-TEXT')\n",
            "{path}:compute_score",
            r"`{path}:compute_score` does not import \(RuntimeError\)",
        ),
        (
            "def compute_score(x:\n  'SECRET-USER-TEXT'\n",
            "{path}",
            r"does not import \(SyntaxError\): run it with python to see why",
        ),
        ("import spotrl_no_such_module_SECRET\n", "{path}", r"does not import \(ModuleNotFoundError\)"),
        ("SECRET = 1\n", "{path}:score_it", r"the module defines no `score_it`"),
        ("compute_score = 'SECRET-USER-TEXT'\n", "{path}", r"`compute_score` is not a function"),
        (
            "def compute_score(a, b):\n    return 'SECRET'\n",
            "{path}",
            r"takes \(a, b\); it should take \(data_source, solution_str, ground_truth, extra_info=None\), or for a batch",
        ),
        (
            "def compute_score(data_source, solution_str, ground_truth, extra_info, tokenizer):\n    pass\n",
            "{path}",
            r"needs arguments verl does not pass",
        ),
    ],
    ids=["raises", "syntax", "missing import", "missing function", "not callable", "wrong signature", "extra argument"],
)
def test_a_function_that_cannot_be_served_is_named_never_shown(
    tmp_path: Path, source: str, reference: str, message: str
) -> None:
    path = write(tmp_path, "broken.py", source)
    ref = reference.format(path=path)
    with pytest.raises(UserFunctionError, match=message.format(path=path)) as info:
        function = resolve(ref)
        call_style(load(function), function)
    assert "SECRET" not in str(info.value)


def test_batched_against_the_parameter_names(tmp_path: Path) -> None:
    single = write(tmp_path, "single.py", GSM8K)
    with pytest.raises(UserFunctionError, match="arguments for one response: drop --batched"):
        function = resolve(str(single), batched=True)
        call_style(load(function), function)
    batch = write(tmp_path, "batch.py", BATCHED)
    with pytest.raises(UserFunctionError, match="arguments for a batch: add --batched"):
        function = resolve(str(batch), batched=False)
        call_style(load(function), function)


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("missing.py:compute_score", "reward function file `missing.py` does not exist"),
        ("rewards.py:not-a-name", "is not a reward function reference"),
        (":compute_score", "is not a reward function reference"),
        (
            "spotrl_no_such_package.rewards:compute_score",
            "cannot find module `spotrl_no_such_package.rewards` on the Python path",
        ),
    ],
)
def test_a_reference_that_names_nothing(reference: str, message: str) -> None:
    with pytest.raises(UserFunctionError, match=message):
        resolve(reference)
