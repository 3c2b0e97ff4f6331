"""The function pool: real worker processes running users' reward files, hostile ones included."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.data.reward.function_pool import FunctionPool
from services.data.reward.user_function import Failure, Item, Outcome, UserFunctionError, resolve
from tests.servers.process import gone
from tests.services.data.reward.user_rewards import BATCHED, GSM8K, HOSTILE, MISBEHAVIOURS, write

TIMEOUT_S = 5.0
MEMORY_MB = 512


def good_items() -> list[Item]:
    return [Item("42", "42"), Item("41", "42"), Item(" 7 ", "7")]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FunctionPool]:
    path = write(tmp_path_factory.mktemp("rewards"), "hostile.py", HOSTILE)
    with FunctionPool(resolve(f"{path}:compute_score"), workers=2, timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB) as pool:
        yield pool


def pids_of(outcomes: list[Outcome]) -> set[int]:
    return {int(o.metrics["pid"]) for o in outcomes if o.metrics}


@pytest.mark.parametrize("misbehaviour", list(MISBEHAVIOURS))
def test_a_misbehaving_call_scores_0_with_its_reason_and_the_pool_answers_on(
    hostile: FunctionPool, misbehaviour: str
) -> None:
    items = [Item("42", "42"), Item("42", "42", misbehaviour), *good_items()]

    outcomes = hostile.score(items)

    assert outcomes[1] == Outcome.failed(Failure(MISBEHAVIOURS[misbehaviour]))
    assert [o.score for i, o in enumerate(outcomes) if i != 1] == [1.0, 1.0, 0.0, 1.0]
    assert all(o.failure is None for i, o in enumerate(outcomes) if i != 1)
    # And afterwards, with every worker (a replaced one among them) answering:
    again = hostile.score(good_items() * 4)
    assert [o.score for o in again] == [1.0, 0.0, 1.0] * 4
    assert len(pids_of(again)) == 2


def test_a_hung_worker_is_replaced_with_what_it_started(hostile: FunctionPool, tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    before = pids_of(hostile.score(good_items() * 4))

    outcomes = hostile.score([Item("", None, "child-then-hang", {"pid_file": str(pid_file)})])

    assert outcomes == [Outcome.failed(Failure.TIMEOUT)]
    assert gone({int(pid_file.read_text())}), "the function's own child outlived its worker"
    after = pids_of(hostile.score(good_items() * 4))
    assert len(after) == 2 and len(after & before) == 1
    assert gone(before - after)


def test_a_batch_spreads_over_the_workers(hostile: FunctionPool) -> None:
    outcomes = hostile.score(good_items() * 20)
    assert [o.score for o in outcomes] == [1.0, 0.0, 1.0] * 20
    assert len(pids_of(outcomes)) == 2


def test_concurrent_batches_each_get_their_own_scores(hostile: FunctionPool) -> None:
    results: dict[int, list[float]] = {}

    def run(k: int) -> None:
        items = [Item(str(k), str(k)), Item(str(k), "other"), Item("", "", "raise")] * 5
        results[k] = [o.score for o in hostile.score(items)]

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {k: [1.0, 0.0, 0.0] * 5 for k in range(4)}


def test_a_batched_function_is_called_a_chunk_per_worker(tmp_path: Path) -> None:
    path = write(tmp_path, "batch.py", BATCHED)
    with FunctionPool(resolve(str(path)), workers=2, timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB) as pool:
        outcomes = pool.score([Item("a", "a"), Item("b", "c")] * 3)
        assert [o.score for o in outcomes] == [1.0, 0.0] * 3
        assert [o.metrics["n"] for o in outcomes if o.metrics] == [3.0] * 6
        assert len(pids_of(outcomes)) == 2

        # A chunk whose call raises fails as a whole; the other chunk is scored.
        outcomes = pool.score([Item("a", "a"), Item("a", "a", "raise"), Item("a", "a"), Item("b", "b")])
        assert [o.failure for o in outcomes] == [Failure.EXCEPTION, Failure.EXCEPTION, None, None]
        assert [o.score for o in outcomes] == [0.0, 0.0, 1.0, 1.0]


def test_a_replacement_runs_the_code_that_was_fingerprinted(tmp_path: Path) -> None:
    source = "import os\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    if data_source == 'exit':\n        os._exit(1)\n    return {}\n"
    path = write(tmp_path, "reward.py", source.format("1.0"))
    function = resolve(str(path))
    with FunctionPool(function, workers=1, timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB) as pool:
        assert pool.score([Item("x")]) == [Outcome(1.0)]
        path.write_text(source.format("0.5"))
        assert resolve(str(path)).fingerprint != pool.fingerprint  # the edit has a fingerprint of its own

        assert pool.score([Item("x", None, "exit")]) == [Outcome.failed(Failure.CRASH)]
        assert pool.score([Item("x")]) == [Outcome(1.0)]  # the replacement runs what was fingerprinted


def workers_alive() -> int:
    return sum(p.name == "spotrl-reward-function" for p in multiprocessing.active_children())


def test_a_function_that_does_not_load_stops_the_pool_from_starting(tmp_path: Path) -> None:
    path = write(tmp_path, "broken.py", "raise RuntimeError('SECRET-USER-TEXT')\n")
    pool = FunctionPool(resolve(str(path)), workers=2, timeout_s=TIMEOUT_S)
    before = workers_alive()
    with pytest.raises(UserFunctionError, match=r"does not import \(RuntimeError\)") as info:
        pool.start()
    assert "SECRET" not in str(info.value)
    assert workers_alive() == before
    with pytest.raises(RuntimeError, match="closed"):
        pool.start()


def test_a_memory_limit_too_small_to_import_says_so(tmp_path: Path) -> None:
    path = write(tmp_path, "big.py", "BIG = bytearray(2 << 30)\n" + GSM8K)
    with pytest.raises(UserFunctionError, match="ran out of memory while importing: raise the memory limit"):
        FunctionPool(resolve(str(path)), workers=1, memory_mb=MEMORY_MB).start()


def test_closing_stops_every_worker_even_in_a_call(tmp_path: Path) -> None:
    path = write(tmp_path, "hostile.py", HOSTILE)
    pool = FunctionPool(resolve(str(path)), workers=2, timeout_s=30.0, memory_mb=MEMORY_MB).start()
    pids = pids_of(pool.score(good_items() * 4))
    hung = threading.Thread(target=pool.score, args=([Item("", None, "hang")],), daemon=True)
    hung.start()
    time.sleep(0.2)

    pool.close()

    assert len(pids) == 2 and gone(pids)
    with pytest.raises(RuntimeError, match="not running"):
        pool.score(good_items())
