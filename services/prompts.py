"""Prompt sets: read a run's prompts from an inline list, a JSONL file or an object-store URI.

A prompt set is bounded (``max_bytes``, ``MAX_PROMPTS``) and its errors name the line and the
field, never the content: a file on the server may hold what its reader must not see.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from services.backends.object_store import ObjectNotFoundError, ObjectStore
from services.backends.state_schema import DEFAULT_TENANT
from services.names import tenant_object_key
from services.runspec import PromptItem
from services.server_paths import ServerPathError, check_object_key, check_server_path

STORE_SCHEME = "store://"
# A stored spec's `prompts` when they were given inline: the set itself is kept beside the run
# (``names.prompts_key``), not in every read of the run.
INLINE = "inline"
MAX_PROMPTS = 1_000_000
DEFAULT_MAX_BYTES = 64 << 20


class InvalidPromptsError(ValueError):
    """The prompts of a run spec cannot be read; the message says which line and why."""


def parse_jsonl(data: bytes, origin: str) -> list[PromptItem]:
    """The prompt items of JSONL ``data``; errors name the line and the field, not the content.

    Lines end at "\n" only, as JSONL says: a prompt may hold U+2028 or a form feed, which
    ``str.splitlines`` would cut it at. Lines are counted before any is read, blank ones too (a
    body of 60 MB of newlines held an API thread for close to a minute)."""
    if data.count(b"\n") + (not data.endswith(b"\n")) > MAX_PROMPTS:
        raise InvalidPromptsError(f"{origin} holds more than {MAX_PROMPTS} lines (at most one prompt a line)")
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise InvalidPromptsError(f"{origin} is not UTF-8 text (a JSONL file of {{\"prompt\": ..., \"answer\": ...}} lines)") from None
    items = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            items.append(PromptItem.model_validate_json(line))
        except ValidationError as e:
            first = e.errors(include_input=False, include_url=False, include_context=False)[0]
            where = ".".join(map(str, first["loc"])) or "the line"
            raise InvalidPromptsError(
                f'{origin} line {number} is not a {{"prompt": ..., "answer": ...}} object: {where}: {first["msg"]}'
            ) from None
    if not items:
        raise InvalidPromptsError(f"{origin} holds no prompts")
    return items


def is_store_uri(source: list[PromptItem] | str) -> bool:
    """True for prompts named as `store://<key>` in the object store."""
    return isinstance(source, str) and source.startswith(STORE_SCHEME)


def load_prompts(
    source: list[PromptItem] | str,
    objects: ObjectStore | None,
    *,
    tenant: str = DEFAULT_TENANT,
    allowed_dirs: Sequence[Path] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> list[PromptItem]:
    """The prompt items of a run spec's `prompts`: `store://<key>` is read from ``tenant``'s part
    of ``objects``, a path only inside ``allowed_dirs`` (None: anywhere, for a local command)."""
    if isinstance(source, list):
        return source
    try:
        if is_store_uri(source):
            if objects is None:
                raise InvalidPromptsError("prompts in an object store need one, and none was given")
            key = check_object_key(source[len(STORE_SCHEME):])
            try:
                data = objects.get_bytes(tenant_object_key(tenant, key))
            except ObjectNotFoundError:
                raise InvalidPromptsError(f"no object {key!r} among this tenant's objects (upload it with POST /v1/datasets)") from None
            return parse_jsonl(data, "the prompt set")
        path = check_server_path(source, allowed_dirs)
    except ServerPathError as e:
        raise InvalidPromptsError(str(e)) from None
    return parse_jsonl(_read_bounded(path, max_bytes), "the prompt file")


def _read_bounded(path: Path, max_bytes: int) -> bytes:
    try:
        if not path.is_file():  # not a directory, device or pipe (a pipe would block the reader)
            raise InvalidPromptsError("the prompt file is not a regular file on the server (give an absolute JSONL path)")
        with path.open("rb") as f:
            data = f.read(max_bytes + 1)
    except OSError:
        raise InvalidPromptsError("the prompt file cannot be read as a file on the server (give an absolute JSONL path)") from None
    if len(data) > max_bytes:
        raise InvalidPromptsError(f"the prompt file is larger than the {max_bytes}-byte limit")
    return data


def to_jsonl(items: list[PromptItem]) -> bytes:
    return "".join(item.model_dump_json() + "\n" for item in items).encode()
