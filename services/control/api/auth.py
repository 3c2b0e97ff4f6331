"""Bearer tokens and their tenants: who is calling the API.

The operator keeps the tokens in a JSON file (``SPOTRL_TOKENS_FILE``; in Kubernetes, a mounted
secret), hashed, never in clear:

    {"tokens": [{"sha256": "<hex>", "tenant": "acme", "admin": false, "label": "ci"}]}

``spotrl token add --tenant acme`` makes a token, prints it once and appends its hash. The file
is read again when it changes, so a token is added or revoked without a restart. While the file
is missing or invalid no token is valid (a deleted file revokes every token) and ``/readyz``
fails, until a valid file is back. Without a file configured there is no auth: every caller is
the admin of the one default tenant, and ``spotrl serve`` listens on loopback only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

from services.ports.state.state_schema import DEFAULT_TENANT

log = logging.getLogger(__name__)
_UNREAD = object()  # the stamp of a file not read yet

TOKEN_PREFIX = "srl_"
TENANT_PATTERN = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,62})$")


class TokensFileError(ValueError):
    """The tokens file cannot be used; the message says what to fix (never a token or hash)."""


@dataclass(frozen=True)
class Principal:
    """The caller: the tenant whose runs it sees, or an admin, who sees every tenant's."""

    tenant: str
    admin: bool = False

    def sees(self, tenant: str) -> bool:
        return self.admin or tenant == self.tenant


# Every caller when no tokens are configured: one machine, one user.
NO_AUTH = Principal(DEFAULT_TENANT, admin=True)


def hash_token(token: str) -> str:
    """What the tokens file stores. Tokens are 256 random bits, so one SHA-256 round is enough
    (a slow password hash protects guessable secrets; these cannot be guessed)."""
    return hashlib.sha256(token.encode()).hexdigest()


def check_tenant(tenant: str) -> str:
    if not TENANT_PATTERN.match(tenant):
        raise TokensFileError(
            f"tenant {tenant!r} is not a tenant name: 1-63 characters of a-z, 0-9 and '-', starting with a letter or digit"
        )
    return tenant


def _read(path: Path) -> dict[str, Principal]:
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise TokensFileError(f"cannot read the tokens file {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise TokensFileError(f"the tokens file {path} is not JSON; write it with `spotrl token add`") from None
    entries = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise TokensFileError(f'the tokens file {path} needs a "tokens" list; write it with `spotrl token add`')
    book = {}
    for number, entry in enumerate(entries, start=1):
        digest = entry.get("sha256") if isinstance(entry, dict) else None
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise TokensFileError(f"entry {number} of the tokens file {path} has no sha256 of 64 hex digits")
        book[digest] = Principal(check_tenant(str(entry.get("tenant", ""))), admin=entry.get("admin") is True)
    return book


class TokenBook:
    """The tokens file, read again whenever its modification time or size changes. It fails
    closed: while the file cannot be read or is not valid, no token is valid."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None | object = _UNREAD  # None: the file is missing
        self._book: dict[str, Principal] = {}
        self._problem: str | None = None
        self._refresh()
        if self._problem is not None:  # at start, a bad file stops the server with what to fix
            raise TokensFileError(self._problem)

    def _refresh(self) -> None:
        try:
            st = os.stat(self.path)
            stamp: tuple[int, int] | None = (st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        if stamp == self._stamp:
            return
        with self._lock:
            if stamp == self._stamp:
                return
            try:
                book, problem = _read(self.path), None
            except TokensFileError as e:
                book, problem = {}, str(e)
            if (
                problem is not None and self._stamp is not _UNREAD
            ):  # once per change: the next requests find the same stamp
                log.error("%s; every token is refused until it is fixed", problem)
            elif self._problem is not None:
                log.warning("the tokens file %s is valid again; its tokens are accepted", self.path)
            self._book, self._stamp, self._problem = book, stamp, problem

    def problem(self) -> str | None:
        """What is wrong with the tokens file now (its name, never its content); None when valid."""
        self._refresh()
        return self._problem

    def principal(self, token: str) -> Principal | None:
        """Whose token this is; None for a token the file does not hold, and for every token
        while the file is missing or invalid."""
        self._refresh()
        return self._book.get(hash_token(token))


def add_token(path: Path, *, tenant: str, admin: bool = False, label: str = "") -> str:
    """Make a token for ``tenant``, append its hash to the tokens file (created 0600) and return
    the token: the only time it exists in clear."""
    check_tenant(tenant)
    data: dict = {"tokens": []}
    if path.exists():
        _read(path)  # refuse to extend a file that is not valid
        data = json.loads(path.read_text())
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    data["tokens"].append({"sha256": hash_token(token), "tenant": tenant, "admin": admin, "label": label})
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)
    return token
