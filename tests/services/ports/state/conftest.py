"""The state store on each adapter: a SQLite file, and a database of its own on the session's
PostgreSQL server. Every test that takes ``store`` (or ``store_url``) runs on both."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.ports.state.state_store import StateStore


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty state store's URL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'state.db'}"
    return request.getfixturevalue("postgres").new_database()


@pytest.fixture
def store(store_url: str) -> Iterator[StateStore]:
    s = StateStore(store_url)
    yield s
    s.close()
