"""Paths on the server that a run spec may name, and object keys a tenant may name.

A client of the API is a stranger: it may name a server path (model, prompts, reward model)
only inside the directories the operator allows (``SPOTRL_DATA_DIRS``), and an object only
inside its own tenant's part of the store. A refusal never says whether anything exists
outside those, and never repeats what the client sent.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

MAX_PATH_CHARS = 1024
MAX_NAME_CHARS = 255  # NAME_MAX of Linux file systems: longer names fail every system call
_KEY_SEGMENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
MAX_KEY_CHARS = 512


class ServerPathError(ValueError):
    """A path or key the caller may not use; the message says what is accepted."""


def check_server_path(raw: str, allowed: Sequence[Path] | None) -> Path:
    """``raw`` resolved (symbolic links followed), if it lies inside one of ``allowed``; None
    allows any path (a local command, whose user owns the machine)."""
    if (
        len(raw) > MAX_PATH_CHARS
        or any(ord(c) < 32 for c in raw)
        or any(len(part) > MAX_NAME_CHARS for part in raw.split("/"))
    ):
        raise ServerPathError(
            f"a server path is at most {MAX_PATH_CHARS} printable characters, each name in it at most {MAX_NAME_CHARS}"
        )
    path = Path(raw).expanduser() if allowed is None else Path(raw)
    if allowed is None:
        return path
    if not path.is_absolute():
        raise ServerPathError("a server path must be absolute")
    hint = (
        "server paths are refused: this server allows none (the operator sets SPOTRL_DATA_DIRS); upload prompt sets "
        "with POST /v1/datasets and name them store://datasets/<id>.jsonl"
        if not allowed
        else "a server path must lie inside one of the directories the operator allows (SPOTRL_DATA_DIRS)"
    )
    try:
        resolved = Path(os.path.realpath(path))
    except (OSError, ValueError):
        raise ServerPathError(hint) from None
    if not any(resolved.is_relative_to(d) for d in allowed):
        raise ServerPathError(hint)
    return resolved


def check_object_key(key: str) -> str:
    """A relative key of '/'-separated segments of letters, digits, '.', '_' and '-' (no '..')."""
    segments = key.split("/")
    if not key or len(key) > MAX_KEY_CHARS or not all(_KEY_SEGMENT.match(s) for s in segments):
        raise ServerPathError(
            f"an object key is 1-{MAX_KEY_CHARS} characters of '/'-separated segments of letters, digits, '.', '_' "
            "and '-', each starting with a letter, digit or '_' (e.g. store://datasets/<id>.jsonl)"
        )
    return key


def url_is_allowed(url: str, allowed: Sequence[str]) -> bool:
    """Whether ``url`` names a service under one of the ``allowed`` URL prefixes: the same scheme,
    host and port, and a path under the prefix's. Compared parsed, not as text: as text,
    ``http://reward:8000@elsewhere/`` starts with ``http://reward:8000`` and goes to ``elsewhere``."""
    try:
        target = urlsplit(url)
        if "@" in target.netloc or "\\" in target.netloc:
            return False
        for prefix in map(urlsplit, allowed):
            same_server = (target.scheme, target.hostname, target.port) == (prefix.scheme, prefix.hostname, prefix.port)
            if same_server and (target.path + "/").startswith(prefix.path.rstrip("/") + "/"):
                return True
    except ValueError:  # a port that is not a number, a malformed IPv6 host
        return False
    return False
