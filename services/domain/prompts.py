"""Prompt sets: read a run's prompts from an inline list, an object-store URI or a server path:
a JSONL file, a Parquet file, or a directory written by Hugging Face datasets' ``save_to_disk``.

A row of a file becomes a prompt item through the spec's ``dataset`` fields (``to_item``), so
the ``{"prompt", "answer"}`` lines and verl's layout (``data_source``, ``prompt`` as chat
messages, ``ability``, ``reward_model: {style, ground_truth}``, ``extra_info``) read alike. What
is stored after an upload is the normalised JSONL (``to_jsonl``), which every reader reads back.

A prompt set is bounded (``max_bytes``, ``MAX_PROMPTS``) and its errors name the line or row and
the field, never the content: a file on the server may hold what its reader must not see.
pyarrow is imported only when a Parquet or Arrow set is read: the API's import time is measured.
"""

from __future__ import annotations

import codecs
import itertools
import json
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import pydantic_core
from pydantic import ValidationError

from services.core.server_paths import ServerPathError, check_object_key, check_server_path
from services.domain.names import tenant_object_key
from services.domain.prompt_items import ChatMessage, DatasetFields, PromptItem
from services.ports.objects.object_store import ObjectNotFoundError, ObjectStore
from services.ports.state.state_schema import DEFAULT_TENANT

STORE_SCHEME = "store://"
# A stored spec's `prompts` when they were given inline: the set itself is kept beside the run
# (``names.prompts_key``), not in every read of the run.
INLINE = "inline"
MAX_PROMPTS = 1_000_000
DEFAULT_MAX_BYTES = 64 << 20
# A line holds one prompt (at most 100,000 characters) and its answer (10,000): even written as
# \uXXXX escapes of surrogate pairs that is 1.32M characters, so a longer line is no prompt.
MAX_LINE_CHARS = 2 << 20
# The first bytes of a Parquet file (and its last), and the media type of one sent to the API.
PARQUET_MAGIC = b"PAR1"
PARQUET_MEDIA_TYPE = "application/vnd.apache.parquet"
# Rows decoded at a time from a Parquet row group; an Arrow stream comes in the batches it was written in.
PARQUET_BATCH_ROWS = 1024
# A directory saved by datasets holds a small state.json naming its Arrow files.
MAX_STATE_BYTES = 1 << 20
# Folders of a directory looked at for the splits of a DatasetDict (a large directory is not listed whole).
MAX_ENTRIES_LISTED = 1000
DEFAULT_FIELDS = DatasetFields()
# Union members pydantic names in an error's location ("prompt.str"): not fields of the row.
_TYPE_TAG = re.compile(r"str|int|float|bool|none|(list|dict|function-\w+|constrained-\w+)\[.*\]")


class InvalidPromptsError(ValueError):
    """The prompts of a run spec cannot be read; the message says which line and why."""


def to_item(row: Any, fields: DatasetFields, where: str) -> PromptItem:
    """The prompt item of one row of a prompt set (``where`` names it: "the upload line 3").

    ``prompt`` is the row's ``fields.prompt_key``; ``answer`` is at ``fields.answer_key``, by
    default verl's ``reward_model.ground_truth`` where the row has it, else its ``answer``;
    ``data_source`` is its own; ``extra_info`` is every other field of the row with the row's
    own ``extra_info`` object merged in over them (verl's reward reads its ``extra_info``; a field
    such as ``ability`` reaches the reward there too). The top-level field the answer lies in is
    not passed on. A chat message's null fields are dropped: Arrow writes a struct's absent
    fields as nulls. Errors name the row's field, never its value.

    >>> row = {"data_source": "gsm8k", "prompt": [{"role": "user", "content": "1+1?"}], "ability": "math",
    ...        "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": 0}}
    >>> item = to_item(row, DatasetFields(), "line 1")
    >>> item.answer, item.data_source, item.extra_info
    ('2', 'gsm8k', {'ability': 'math', 'index': 0})
    """
    if not isinstance(row, dict):
        raise InvalidPromptsError(f"{where} is not an object of named fields")
    data: dict[str, Any] = {}
    named = {"prompt": fields.prompt_key, "data_source": "data_source"}  # an item's field -> the row's
    taken = {fields.prompt_key, "data_source", "extra_info"}
    if fields.prompt_key in row:
        prompt = row[fields.prompt_key]
        if isinstance(prompt, list):
            prompt = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in prompt]
        data["prompt"] = prompt
    path = fields.answer_key.split(".") if fields.answer_key else _default_answer_path(row)
    if path:
        named["answer"] = ".".join(path)
        taken.add(path[0])
        value = row
        for part in path:
            if not isinstance(value, dict) or part not in value:
                raise InvalidPromptsError(
                    f"{where} is not a prompt row: {named['answer']}: Field required (its answer)"
                )
            value = value[part]
        data["answer"] = value
    if "data_source" in row:
        data["data_source"] = row["data_source"]
    extra = {k: v for k, v in row.items() if k not in taken}
    own = row.get("extra_info")
    if own is not None and not isinstance(own, dict):
        data["extra_info"] = own  # refused below, as `extra_info`
    elif extra or own:
        data["extra_info"] = {**extra, **(own or {})}
    try:
        return PromptItem.model_validate(data)
    except ValidationError as e:
        # The deepest error: of a union (text or chat messages), the member that came closest.
        first = max(
            e.errors(include_input=False, include_url=False, include_context=False), key=lambda err: len(err["loc"])
        )
        loc = [str(part) for part in first["loc"] if not _TYPE_TAG.fullmatch(str(part))]
        if loc and loc[0] == "extra_info" and len(loc) > 1 and not (isinstance(own, dict) and loc[1] in own):
            loc = loc[1:]  # a top-level field of the row, passed on in extra_info
        elif loc:
            loc = [*named.get(loc[0], loc[0]).split("."), *loc[1:]]
        known = {*_ITEM_FIELDS, *(part for name in named.values() for part in name.split("."))}
        # pydantic's message for an unknown field is "Extra inputs are not permitted"; say which kind of input.
        message = "unknown field; remove it from the file" if first["type"] == "extra_forbidden" else first["msg"]
        raise InvalidPromptsError(
            f"{where} is not a prompt row: {_shown_location(loc, row, known)}: {message}"
        ) from None


# Names of a row's fields the server itself gives (the prompt item's, a chat message's, verl's layout):
# an error may repeat these, while any other name in a row is the file's content.
_ITEM_FIELDS = frozenset({*PromptItem.model_fields, *ChatMessage.model_fields, "reward_model", "ground_truth"})


def _shown_location(loc: list[str], row: dict[str, Any], known: set[str]) -> str:
    """Where in ``row`` an error lies, as an error may say it: a field the server names by its
    name, an item of a list by its index, and any other field by its position in its object
    ("(field 3)"), because a name the file chose is the file's content (``<script>`` in an
    error page, or a secret a column was named after)."""
    shown = []
    value: Any = row
    for part in loc:
        position = list(value).index(part) + 1 if isinstance(value, dict) and part in value else None
        if part in known or (isinstance(value, list) and part.isdigit()):
            shown.append(part)
        else:
            shown.append(f"(field {position})" if position else "(a field)")
        value = value[part] if position else value[int(part)] if isinstance(value, list) and part.isdigit() else None
    return ".".join(shown) or "the row"


def _default_answer_path(row: dict[str, Any]) -> list[str] | None:
    reward_model = row.get("reward_model")
    if isinstance(reward_model, dict) and "ground_truth" in reward_model:
        return ["reward_model", "ground_truth"]
    return ["answer"] if "answer" in row else None


class JsonlParser:
    r"""The prompt items of JSONL fed in pieces as it arrives (an upload): each line is parsed as
    soon as it is whole, and only the partial last line is held, so the raw set is never held.
    Errors name the line and the field, not the content. Given ``on_item``, each item is handed to
    it as it is read and not kept (an upload written out as it arrives): ``count`` counts them.

    Each line is a row mapped by ``fields`` (``to_item``). Lines end at "\n" only, as JSONL says:
    a prompt may hold U+2028 or a form feed, which ``str.splitlines`` would cut it at. A piece's
    lines are counted before any of them is read, blank ones too (a body of 60 MB of newlines
    held an API thread for close to a minute), and a line is refused as soon as it grows past
    MAX_LINE_CHARS, before it is whole.

    >>> parser = JsonlParser("the upload")
    >>> parser.feed(b'{"prompt": "a"}\n{"pro'); parser.feed(b'mpt": "b"}')
    >>> [item.prompt for item in parser.finish()]
    ['a', 'b']
    """

    def __init__(
        self, origin: str, fields: DatasetFields = DEFAULT_FIELDS, on_item: Callable[[PromptItem], object] | None = None
    ) -> None:
        self.origin = origin
        self.fields = fields
        self.items: list[PromptItem] = []
        self.count = 0  # items read
        self._take: Callable[[PromptItem], object] = on_item or self.items.append
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
        """Every prompt item (none kept when ``on_item`` took them), once the last piece is fed;
        InvalidPromptsError if there is none."""
        self._decode(b"", final=True)  # a character cut short at the end
        if self._partial_chars:
            if self._lines + 1 > MAX_PROMPTS:
                raise self._too_many_lines()
            self._line("".join(self._partial))
            self._partial, self._partial_chars = [], 0
        if not self.count:
            raise InvalidPromptsError(f"{self.origin} holds no prompts")
        return self.items

    def _decode(self, piece: bytes, final: bool = False) -> str:
        try:
            return self._decoder.decode(piece, final)
        except UnicodeDecodeError:
            raise InvalidPromptsError(
                f'{self.origin} is not UTF-8 text (a JSONL file of {{"prompt": ..., "answer": ...}} lines)'
            ) from None

    def _line(self, line: str) -> None:
        self._lines += 1
        if len(line) > MAX_LINE_CHARS:
            raise self._too_long(self._lines)
        if not line.strip():
            return
        if self.fields == DEFAULT_FIELDS:
            try:  # a line of a prompt item's own fields (a stored set, {"prompt", "answer"}): read as it is, fast
                item = PromptItem.model_validate_json(line)
            except ValidationError:
                pass  # verl's layout, or a bad line: mapped, and the mapping names what is wrong
            else:
                self._add(item)
                return
        where = f"{self.origin} line {self._lines}"
        try:
            row = pydantic_core.from_json(line, allow_inf_nan=False)
        except ValueError:
            raise InvalidPromptsError(f"{where} is not a JSON object (one prompt row a line)") from None
        self._add(to_item(row, self.fields, where))

    def _add(self, item: PromptItem) -> None:
        self.count += 1
        self._take(item)

    def _too_many_lines(self) -> InvalidPromptsError:
        return InvalidPromptsError(f"{self.origin} holds more than {MAX_PROMPTS} lines (at most one prompt a line)")

    def _too_long(self, number: int) -> InvalidPromptsError:
        return InvalidPromptsError(
            f"{self.origin} line {number} is longer than {MAX_LINE_CHARS} characters (one prompt and its answer)"
        )


def parse_jsonl(data: bytes, origin: str, fields: DatasetFields = DEFAULT_FIELDS) -> list[PromptItem]:
    """The prompt items of JSONL ``data`` held whole (``JsonlParser`` fed one piece)."""
    parser = JsonlParser(origin, fields)
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
    fields: DatasetFields = DEFAULT_FIELDS,
) -> list[PromptItem]:
    """The prompt items of a run spec's `prompts`: `store://<key>` is read from ``tenant``'s part
    of ``objects`` (a set stored normalised, read as it is), a path only inside ``allowed_dirs``
    (None: anywhere, for a local command), its rows mapped by ``fields``: a Parquet file (by its
    first bytes), a directory saved by datasets' ``save_to_disk``, else a JSONL file."""
    if isinstance(source, list):
        return source
    try:
        if is_store_uri(source):
            if objects is None:
                raise InvalidPromptsError("prompts in an object store need one, and none was given")
            key = check_object_key(source[len(STORE_SCHEME) :])
            try:
                data = objects.get_bytes(tenant_object_key(tenant, key))
            except ObjectNotFoundError:
                raise InvalidPromptsError(
                    "no such object among this tenant's objects (upload it with POST /v1/datasets)"
                ) from None
            return parse_jsonl(data, "the prompt set")
        path = check_server_path(source, allowed_dirs)
        if _is_dir(path):
            return read_saved_dataset(path, fields=fields, allowed_dirs=allowed_dirs, max_bytes=max_bytes)
    except ServerPathError as e:
        raise InvalidPromptsError(str(e)) from None
    data = _read_bounded(path, max_bytes)
    if data.startswith(PARQUET_MAGIC):
        return read_parquet(
            data, "the prompt file", fields=fields, max_bytes=max_bytes
        )  # the bytes checked, not read again
    return parse_jsonl(data, "the prompt file", fields)


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False


def _read_bounded(path: Path, max_bytes: int) -> bytes:
    try:
        if not path.is_file():  # not a device or pipe (a pipe would block the reader)
            raise InvalidPromptsError(
                "the prompt file is not a regular file or a directory on the server (give an absolute JSONL or Parquet path)"
            )
        with path.open("rb") as f:
            data = f.read(max_bytes + 1)
    except OSError:
        raise InvalidPromptsError(
            "the prompt file cannot be read as a file on the server (give an absolute JSONL or Parquet path)"
        ) from None
    if len(data) > max_bytes:
        raise InvalidPromptsError(f"the prompt file is larger than the {max_bytes}-byte limit")
    return data


def read_parquet(
    source: bytes | IO[bytes],
    origin: str,
    *,
    fields: DatasetFields = DEFAULT_FIELDS,
    max_bytes: int = DEFAULT_MAX_BYTES,
    on_item: Callable[[PromptItem], object] | None = None,
) -> list[PromptItem]:
    """The prompt items of a Parquet file (its bytes, or a file object such as a spooled upload),
    decoded PARQUET_BATCH_ROWS rows at a time, row group by row group. Its metadata is checked
    first (rows, declared sizes); then the rows decoded so far are counted against MAX_PROMPTS
    and their bytes against ``max_bytes``, so a small file that inflates is refused as it does.
    Given ``on_item``, each item goes to it as it is read and none is kept (the list is empty)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(pa.BufferReader(source) if isinstance(source, bytes) else source)
        metadata = file.metadata
        declared = sum(metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups))
    except (pa.ArrowException, OSError, ValueError, TypeError):
        raise InvalidPromptsError(f"{origin} is not a Parquet file that can be read") from None
    if metadata.num_rows > MAX_PROMPTS:
        raise InvalidPromptsError(f"{origin} holds more than {MAX_PROMPTS} rows (one prompt a row)")
    if declared > max_bytes:
        raise InvalidPromptsError(f"{origin} is larger than the {max_bytes}-byte limit once decoded")
    rows = _Rows(origin, fields, max_bytes, on_item)
    rows.read(file.iter_batches(batch_size=PARQUET_BATCH_ROWS))
    return rows.finish()


def read_saved_dataset(
    directory: Path,
    *,
    fields: DatasetFields = DEFAULT_FIELDS,
    allowed_dirs: Sequence[Path] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> list[PromptItem]:
    """The prompt items of a directory written by ``datasets.Dataset.save_to_disk``: the Arrow
    files its state.json names, in that order, each an Arrow stream read batch by batch (no
    ``datasets`` import). A DatasetDict's directory (a folder per split) is refused with its splits."""
    import pyarrow as pa

    origin = "the prompt directory"
    state_file = directory / "state.json"
    if not state_file.is_file():
        try:
            splits = sorted(
                e.name
                for e in itertools.islice(directory.iterdir(), MAX_ENTRIES_LISTED)
                if (e / "state.json").is_file()
            )
        except OSError:
            splits = []
        if splits:
            raise InvalidPromptsError(
                f"{origin} holds a DatasetDict: name the folder of one of its splits inside it ({', '.join(splits[:20])})"
            )
        raise InvalidPromptsError(f"{origin} is not one written by datasets' save_to_disk (it has no state.json)")
    files = [check_server_path(str(directory / name), allowed_dirs) for name in _arrow_files(state_file, origin)]
    rows = _Rows(origin, fields, max_bytes)
    try:
        if sum(f.stat().st_size for f in files) > max_bytes:
            raise InvalidPromptsError(f"{origin}'s Arrow files are larger than the {max_bytes}-byte limit")
        for f in files:
            with f.open("rb") as stream:
                try:
                    reader = pa.ipc.open_stream(stream)
                except (pa.ArrowException, ValueError):
                    raise InvalidPromptsError(
                        f"{origin}'s {f.name} is not an Arrow stream (as save_to_disk writes)"
                    ) from None
                rows.read(reader)
    except OSError:
        raise InvalidPromptsError(f"{origin}'s Arrow files cannot be read on the server") from None
    return rows.finish()


def _arrow_files(state_file: Path, origin: str) -> list[str]:
    """The names of the Arrow files a save_to_disk state.json lists: plain names in its directory."""
    try:
        with state_file.open("rb") as f:
            state = json.loads(f.read(MAX_STATE_BYTES))
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, TypeError, KeyError):
        names = None
    if not names or not all(
        isinstance(n, str) and n.endswith(".arrow") and "/" not in n and "\\" not in n and not n.startswith(".")
        for n in names
    ):
        raise InvalidPromptsError(f"{origin}'s state.json is not one that datasets' save_to_disk writes (_data_files)")
    return names


class _Rows:
    """The prompt items of Arrow record batches, read one batch at a time, each row mapped by
    ``fields``; the rows and the bytes decoded are counted as they come, over every batch read."""

    def __init__(
        self, origin: str, fields: DatasetFields, max_bytes: int, on_item: Callable[[PromptItem], object] | None = None
    ) -> None:
        self.origin, self.fields, self.max_bytes = origin, fields, max_bytes
        self.items: list[PromptItem] = []
        self.count = 0  # items read, kept or handed to on_item
        self._take: Callable[[PromptItem], object] = on_item or self.items.append
        self.decoded = 0

    def read(self, batches: Iterable[Any]) -> None:
        import pyarrow as pa

        it: Iterator[Any] = iter(batches)
        while True:
            try:
                batch = next(it, None)
                rows = [] if batch is None else self._count(batch).to_pylist()
            except (pa.ArrowException, OSError, ValueError, TypeError, OverflowError) as e:
                if isinstance(e, InvalidPromptsError):
                    raise
                raise InvalidPromptsError(
                    f"{self.origin} cannot be read after row {self.count}: its data is damaged or of a type not supported"
                ) from None
            if batch is None:
                return
            for row in rows:
                self.count += 1
                self._take(to_item(row, self.fields, f"{self.origin} row {self.count}"))

    def finish(self) -> list[PromptItem]:
        if not self.count:
            raise InvalidPromptsError(f"{self.origin} holds no prompts")
        return self.items

    def _count(self, batch: Any) -> Any:
        self.decoded += batch.nbytes
        if self.decoded > self.max_bytes:
            raise InvalidPromptsError(f"{self.origin} is larger than the {self.max_bytes}-byte limit once decoded")
        if self.count + batch.num_rows > MAX_PROMPTS:
            raise InvalidPromptsError(f"{self.origin} holds more than {MAX_PROMPTS} rows (one prompt a row)")
        return batch


def to_jsonl(items: list[PromptItem]) -> bytes:
    return "".join(item.model_dump_json() + "\n" for item in items).encode()
