"""Rotation of policy versions and trainer states: the rule (known values), then applied
through the object store port, on the local adapter and on S3 (moto, tests/servers/s3.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.domain.names import policy_prefix, result_key, trainer_prefix
from services.domain.policy_rotation import KEEP_VERSIONS, Rotated, rotate, versions_to_delete
from services.ports.objects.local_object_store import LocalObjectStore
from services.ports.objects.object_store import ObjectStore
from services.ports.objects.s3_object_store import S3ObjectStore


@pytest.mark.parametrize(
    ("present", "latest", "in_use", "keep", "deleted"),
    [
        ([1, 2, 3, 4, 5], 5, [], 3, [1, 2]),  # the last 3 kept
        ([5, 3, 1, 4, 2], 5, [], 2, [1, 2, 3]),  # in any order; keep 2: latest and the one before
        ([1, 2, 3, 4, 5], 5, [1], 3, [2]),  # a version a worker holds is kept
        ([1, 2, 3, 4, 5, 6], 5, [], 3, [1, 2]),  # v6: published, not yet recorded: kept
        ([1, 2, 3, 4, 5, 6], 6, [], 3, [1, 2, 3]),
        ([1, 2], 2, [], 3, []),  # fewer than keep
        ([], 7, [], 3, []),
        ([0, 1, 2, 3], 3, [], 2, [1]),  # v0 is the base model, never deleted
        ([3, 4, 9], 9, [4], 2, [3]),  # gaps: the jobs that made 5-8 already rotated them
    ],
)
def test_which_versions_are_deleted(present, latest, in_use, keep, deleted) -> None:
    assert versions_to_delete(present, latest=latest, in_use=in_use, keep=keep) == deleted


def test_the_default_keeps_three_and_fewer_than_two_is_refused() -> None:
    assert KEEP_VERSIONS == 3
    assert versions_to_delete(range(1, 11), latest=10) == [1, 2, 3, 4, 5, 6, 7]
    for keep in (1, 0, -1):
        with pytest.raises(ValueError, match="at least 2"):
            versions_to_delete([1, 2, 3], latest=3, keep=keep)


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "local":
        return LocalObjectStore(tmp_path / "objects")
    return S3ObjectStore.from_url(request.getfixturevalue("s3_bucket").url)


def _publish(store: ObjectStore, run_id: str, version: int) -> None:
    """What a training job stores for ``version``: its policy, its trainer state, its result."""
    store.put_bytes(policy_prefix(run_id, version) + "model.safetensors", b"w")
    store.put_bytes(policy_prefix(run_id, version) + "config.json", b"{}")
    store.put_bytes(trainer_prefix(run_id, version) + "optimizer/rank0.pt", b"o")
    store.put_bytes(trainer_prefix(run_id, version) + "value_head.pt", b"v")
    store.put_bytes(result_key(run_id, version), b"{}")


def _versions(store: ObjectStore, prefix: str) -> dict[int, list[str]]:
    """version -> the names under runs/r/<prefix>/v<N>/."""
    found: dict[int, list[str]] = {}
    for key in store.list(f"runs/r/{prefix}/"):
        version, _, name = key.removeprefix(f"runs/r/{prefix}/v").partition("/")
        found.setdefault(int(version), []).append(name)
    return found


def test_rotation_through_the_port(store: ObjectStore) -> None:
    for version in range(1, 7):
        _publish(store, "r", version)  # v6 published, not yet recorded
    store.put_bytes(trainer_prefix("r", 1) + "optimizer.pt", b"a legacy one-file state")
    store.put_bytes("runs/r/prompts.jsonl", b"{}")
    _publish(store, "r2", 1)  # another run's
    state = ["config.json", "model.safetensors"]
    trainer = ["optimizer/rank0.pt", "result.json", "value_head.pt"]

    # Recorded v5, a worker still holding v1: v2 goes.
    assert rotate(store, "r", latest=5, in_use=[1], keep=3) == Rotated(policies=[2], trainer_states=[2])
    assert _versions(store, "policy") == dict.fromkeys((1, 3, 4, 5, 6), state)
    assert _versions(store, "trainer") == {
        1: ["optimizer.pt", *trainer],
        2: ["result.json"],
        3: trainer,
        4: trainer,
        5: trainer,
        6: trainer,
    }
    assert rotate(store, "r", latest=5, in_use=[1], keep=3) == Rotated(policies=[], trainer_states=[])  # idempotent

    # v6 recorded, no worker on v1 any more.
    assert rotate(store, "r", latest=6) == Rotated(policies=[1, 3], trainer_states=[1, 3])
    assert _versions(store, "policy") == dict.fromkeys((4, 5, 6), state)
    assert _versions(store, "trainer") == {
        1: ["result.json"],
        2: ["result.json"],
        3: ["result.json"],
        4: trainer,
        5: trainer,
        6: trainer,
    }
    assert store.exists("runs/r/prompts.jsonl")
    assert len(store.list("runs/r2/")) == 5


def test_rotation_and_the_s3_adapter_import_no_torch() -> None:
    """The scheduler (control plane, no torch) calls it."""
    code = (
        "import sys, services.domain.policy_rotation, services.ports.objects.s3_object_store, services.ports.wiring\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'trainer_core'))\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[3], timeout=120)
