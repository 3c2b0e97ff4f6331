"""Render the README's run-spec and settings tables from the models' own field descriptions
(`services.domain.runspec.RunSpec`, `services.core.config.Settings`), so that what the README says a field
means is what the API's OpenAPI document and `--help` say, and a new field cannot be forgotten.

    .venv/bin/python scripts/readme_tables.py          # exit 1, saying so, when the README's tables are stale
    .venv/bin/python scripts/readme_tables.py --write  # rewrite them between their marker comments
"""

from __future__ import annotations

import enum
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
sys.path.insert(0, str(ROOT))  # run as a script, the repository's packages are importable too

from services.core.config import Settings  # noqa: E402
from services.domain.prompt_items import PromptItem  # noqa: E402
from services.domain.runspec import RunSpec  # noqa: E402

# The README's tables, each between `<!-- <name>:start -->` and `<!-- <name>:end -->`.
RUN_SPEC_TABLE = "run-spec-table"
SETTINGS_TABLE = "settings-table"
# Models whose fields are not spec settings of their own: an inline prompt is described by `prompts`.
NOT_EXPANDED = (PromptItem,)


def run_spec_table() -> str:
    """One row per field of a run spec, a section's fields (`sampling.temperature`) after it."""
    rows = ["| field | default | meaning |", "|---|---|---|"]
    rows += _model_rows(RunSpec, "")
    return "\n".join(rows)


def settings_table() -> str:
    """One row per process setting, named by its environment variable."""
    prefix = Settings.model_config.get("env_prefix", "")
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        rows.append(_row(f"{prefix}{name}".upper(), field))
    return "\n".join(rows)


def _model_rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        rows.append(_row(path, field))
        for section in _sections(field.annotation):
            rows += _model_rows(section, f"{path}[]." if _is_list(field.annotation) else f"{path}.")
    return rows


def _sections(annotation: Any) -> list[type[BaseModel]]:
    """The models a field's value is made of (its own, or its list's items'), whose fields get rows."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [] if issubclass(annotation, NOT_EXPANDED) else [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list):
        return [model for arg in typing.get_args(annotation) for model in _sections(arg)]
    if typing.get_origin(annotation) is typing.Annotated:
        return _sections(typing.get_args(annotation)[0])
    return []


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is list


def _row(name: str, field: FieldInfo) -> str:
    if not field.description:
        raise SystemExit(f"{name} has no description: give its Field a description= (one short sentence)")
    return f"| `{name}` | {_default(field)} | {_cell(field.description)} |"


def _default(field: FieldInfo) -> str:
    """A field's default as a reader writes it: JSON for values, "required", "—" for none, and
    nothing for a section, whose own fields' rows give its defaults."""
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None or value == "":
        return "—"
    if isinstance(value, BaseModel):
        return ""
    if isinstance(value, list) and all(isinstance(item, BaseModel) for item in value):
        value = [item.model_dump(mode="json", exclude_defaults=True) for item in value]
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool | int | float):
        return json.dumps(value)
    if isinstance(value, str | Path):
        return f"`{_cell(str(value))}`"
    return f"`{_cell(json.dumps(value))}`"


def _cell(text: str) -> str:
    """Text that stays in its table cell and shows as written: one line, `|` escaped, and `<`
    escaped so that `<think>` or `<id>` is not taken for an HTML tag and hidden."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "\\<")


def rendered(readme: str) -> str:
    """`readme` with each table between its markers replaced by the rendered one."""
    for name, table in ((RUN_SPEC_TABLE, run_spec_table()), (SETTINGS_TABLE, settings_table())):
        start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
        if readme.count(start) != 1 or readme.count(end) != 1:
            raise SystemExit(f"README.md needs one `{start}` and one `{end}` line around the table")
        head, rest = readme.split(start)
        _, tail = rest.split(end)
        readme = f"{head}{start}\n{table}\n{end}{tail}"
    return readme


def main(argv: list[str]) -> int:
    readme = README.read_text()
    fresh = rendered(readme)
    if "--write" in argv:
        README.write_text(fresh)
        return 0
    if fresh != readme:
        print(
            "README.md's run-spec or settings table differs from the models' descriptions: run scripts/readme_tables.py --write"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
