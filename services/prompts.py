"""Prompt sets: read a run's prompts from an inline list, a JSONL file or an object-store URI.

A prompt set is bounded (``max_bytes``, ``MAX_PROMPTS``) and its errors name the line and the
field, never the content: a file on the server may hold what its reader must not see.
"""

from __future__ import annotations

import codecs
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
# A line holds one prompt (at most 100,000 characters) and its answer (10,000): even written as
# \uXXXX escapes of surrogate pairs that is 1.32M characters, so a longer line is no prompt.
MAX_LINE_CHARS = 2 << 20


class InvalidPromptsError(ValueError):
    """The prompts of a run spec cannot be read; the message says which line and why."""


class JsonlParser:
    r"""The prompt items of JSONL fed in pieces as it arrives (an upload): each line is parsed as
    soon as it is whole, and only the partial last line is held, so the raw set is never held.
    Errors name the line and the field, not the content.

    Lines end at "\n" only, as JSONL says: a prompt may hold U+2028 or a form feed, which
    ``str.splitlines`` would cut it at. A piece's lines are counted before any of them is read,
    blank ones too (a body of 60 MB of newlines held an API thread for close to a minute), and a
    line is refused as soon as it grows past MAX_LINE_CHARS, before it is whole.

    >>> parser = JsonlParser("the upload")
    >>> parser.feed(b'{"prompt": "a"}\n{"pro'); parser.feed(b'mpt": "b"}')
    >>> [item.prompt for item in parser.finish()]
    ['a', 'b']
    """

    def __init__(self, origin: str) -> None:
        self.origin = origin
        self.items: list[PromptItem] = []
        self.bytes_read = 0
        self._lines = 0  # lines read, blank ones included
        # Decoded piece by piece: a character's bytes may be cut between two pieces.
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._partial: list[str] = []  # the last line's text so far, in the pieces it came in
        self._partial_chars = 0

    def feed(self, piece: bytes) -> None:
        self.bytes_read += len(piece)
        if self._lines + piece.count(b"\n") > MAX_PROMPTS:
            raise self._too_many_lines()
        *whole, rest = self._decode(piece).split("\n")
        for line in whole:
            self._partial.append(line)
            self._line("".join(self._partial))
            self._partial, self._partial_chars = [], 0
        self._partial.append(rest)
        self._partial_chars += len(rest)
        if self._partial_chars > MAX_LINE_CHARS:
            raise self._too_long(self._lines + 1)

    def finish(self) -> list[PromptItem]:
        """Every prompt item, once the last piece is fed; InvalidPromptsError if there is none."""
        self._decode(b"", final=True)  # a character cut short at the end
        if self._partial_chars:
            if self._lines + 1 > MAX_PROMPTS:
                raise self._too_many_lines()
            self._line("".join(self._partial))
            self._partial, self._partial_chars = [], 0
        if not self.items:
            raise InvalidPromptsError(f"{self.origin} holds no prompts")
        return self.items

    def _decode(self, piece: bytes, final: bool = False) -> str:
        try:
            return self._decoder.decode(piece, final)
        except UnicodeDecodeError:
            raise InvalidPromptsError(
                f"{self.origin} is not UTF-8 text (a JSONL file of {{\"prompt\": ..., \"answer\": ...}} lines)"
            ) from None

    def _line(self, line: str) -> None:
        self._lines += 1
        if len(line) > MAX_LINE_CHARS:
            raise self._too_long(self._lines)
        if not line.strip():
            return
        try:
            self.items.append(PromptItem.model_validate_json(line))
        except ValidationError as e:
            first = e.errors(include_input=False, include_url=False, include_context=False)[0]
            where = ".".join(map(str, first["loc"])) or "the line"
            raise InvalidPromptsError(
                f'{self.origin} line {self._lines} is not a {{"prompt": ..., "answer": ...}} object: {where}: {first["msg"]}'
            ) from None

    def _too_many_lines(self) -> InvalidPromptsError:
        return InvalidPromptsError(f"{self.origin} holds more than {MAX_PROMPTS} lines (at most one prompt a line)")

    def _too_long(self, number: int) -> InvalidPromptsError:
        return InvalidPromptsError(f"{self.origin} line {number} is longer than {MAX_LINE_CHARS} characters (one prompt and its answer)")


def parse_jsonl(data: bytes, origin: str) -> list[PromptItem]:
    """The prompt items of JSONL ``data`` held whole (``JsonlParser`` fed one piece)."""
    parser = JsonlParser(origin)
    parser.feed(data)
    return parser.finish()


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
