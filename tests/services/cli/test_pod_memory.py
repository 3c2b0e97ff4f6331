"""A pod's memory reported to the state store while it runs (``services.cli.pods``)."""

from __future__ import annotations

import time
from contextlib import closing
from pathlib import Path

import pytest

from services.cli import pods as cli_pods
from services.ports.launcher.launcher import POD_NAME_ENV, POD_ROLE_ENV
from services.ports.state.state_store import StateStore


def test_a_pod_reports_its_memory_at_once_then_every_period_until_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(POD_NAME_ENV, "r1-rollout-0")
    monkeypatch.setenv(POD_ROLE_ENV, "rollout")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(cli_pods, "MEMORY_REPORT_S", 0.2)
    with closing(StateStore(f"sqlite:///{tmp_path / 'state.db'}")) as state:
        state.create_run("r1", name=None, spec={})
        with cli_pods._memory_reported(state, "r1"):
            held = bytearray(64 << 20)  # noqa: F841 - resident while the reports are taken
            time.sleep(0.7)
        reports = state.pod_memory("r1")
        time.sleep(0.4)
        assert len(state.pod_memory("r1")) == len(reports)  # none after the pod's work ended
    assert 3 <= len(reports) <= 6
    assert {(r.pod, r.role) for r in reports} == {("r1-rollout-0", "rollout")}
    assert all(64 << 20 < r.bytes <= r.peak_bytes for r in reports)  # this process's RSS holds the 64 MiB


def test_a_process_the_scheduler_did_not_start_reports_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(POD_NAME_ENV, raising=False)
    with closing(StateStore(f"sqlite:///{tmp_path / 'state.db'}")) as state:
        state.create_run("r1", name=None, spec={})
        with cli_pods._memory_reported(state, "r1"):
            pass
        assert state.pod_memory("r1") == []
