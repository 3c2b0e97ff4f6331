"""Fixtures of the tracking tests: a SQLite state store, the shipped price catalog, and the
session's real MLflow server (tests/servers/mlflow.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.ports.prices.catalog import PriceCatalog, load_catalog
from services.ports.state.state_store import StateStore
from tests.servers.mlflow import mlflow_auth_server, mlflow_server  # noqa: F401 - the fixtures


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StateStore]:
    s = StateStore(f"sqlite:///{tmp_path / 'state.db'}")
    yield s
    s.close()


@pytest.fixture
def catalog() -> PriceCatalog:
    return load_catalog()
