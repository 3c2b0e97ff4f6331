"""Prompt sets: read a run's prompts from an inline list, a JSONL file or an object-store URI."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from services.backends.object_store import ObjectNotFoundError, ObjectStore
from services.runspec import PromptItem

STORE_SCHEME = "store://"


class InvalidPromptsError(ValueError):
    """The prompts of a run spec cannot be read; the message says which line and why."""


def parse_jsonl(text: str, origin: str) -> list[PromptItem]:
    items = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            items.append(PromptItem.model_validate(json.loads(line)))
        except (json.JSONDecodeError, ValidationError) as e:
            raise InvalidPromptsError(
                f'{origin} line {number} is not a {{"prompt": ..., "answer": ...}} object: {e}'
            ) from None
    if not items:
        raise InvalidPromptsError(f"{origin} holds no prompts")
    return items


def is_store_uri(source: list[PromptItem] | str) -> bool:
    """True for prompts named as `store://<key>` in the object store."""
    return isinstance(source, str) and source.startswith(STORE_SCHEME)


def load_prompts(source: list[PromptItem] | str, objects: ObjectStore | None) -> list[PromptItem]:
    """The prompt items of a run spec's `prompts` (`objects` is read for `store://` only)."""
    if isinstance(source, list):
        return source
    if is_store_uri(source):
        if objects is None:
            raise InvalidPromptsError(f"prompts {source!r} are in an object store, and none was given")
        key = source[len(STORE_SCHEME):]
        try:
            return parse_jsonl(objects.get_bytes(key).decode(), source)
        except ObjectNotFoundError:
            raise InvalidPromptsError(f"no object {key!r} in the object store") from None
    path = Path(source).expanduser()
    if not path.is_file():
        raise InvalidPromptsError(f"prompt file {source!r} does not exist on the server (give an absolute JSONL path)")
    return parse_jsonl(path.read_text(), source)


def to_jsonl(items: list[PromptItem]) -> bytes:
    return "".join(item.model_dump_json() + "\n" for item in items).encode()
