"""The README's run-spec and settings tables are the ones the models' field descriptions render:
a field added, renamed or described anew shows in the README once `--write` has run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "readme_tables.py"


@pytest.fixture(scope="module")
def readme_tables():
    spec = importlib.util.spec_from_file_location("readme_tables", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_tables_are_the_rendered_ones(readme_tables) -> None:
    readme = readme_tables.README.read_text()
    assert readme_tables.rendered(readme) == readme, "run .venv/bin/python scripts/readme_tables.py --write"


def test_every_run_spec_field_and_setting_has_a_row(readme_tables) -> None:
    from services.core.config import Settings

    spec_table, settings = readme_tables.run_spec_table(), readme_tables.settings_table()
    for row in (
        "| `sampling.temperature` | 1.0 |",
        "| `reward[].pattern` | — |",
        "| `training.learning_rate` | 1e-05 |",
        "| `model` | required |",
    ):
        assert row in spec_table
    for name in Settings.model_fields:
        assert f"| `SPOTRL_{name.upper()}` |" in settings


def test_a_field_without_a_description_is_refused(readme_tables) -> None:
    from pydantic import Field

    with pytest.raises(SystemExit, match="has no description"):
        readme_tables._row("x", Field(default=1))


def test_the_check_says_how_to_fix_a_stale_table(readme_tables, monkeypatch, tmp_path, capsys) -> None:
    stale = tmp_path / "README.md"
    stale.write_text(readme_tables.README.read_text().replace("| `SPOTRL_HOME` |", "| `SPOTRL_HOME_OLD` |"))
    monkeypatch.setattr(readme_tables, "README", stale)
    assert readme_tables.main([]) == 1
    assert "scripts/readme_tables.py --write" in capsys.readouterr().out
    assert readme_tables.main(["--write"]) == 0 and readme_tables.main([]) == 0
