"""The HTTP client of the spotrl API, and where the server and token come from.

Server and token are taken from flags, then the environment (``SPOTRL_SERVER``,
``SPOTRL_TOKEN``), then the config file (``SPOTRL_CONFIG``, else
``$XDG_CONFIG_HOME/spotrl/config.yaml``, else ``~/.config/spotrl/config.yaml``), first found wins.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

# Pages asked of GET /v1/runs while following its cursor (the API allows up to 200).
DEFAULT_PAGE_SIZE = 50
# Ledger entries asked per page of GET /v1/runs/{id}/cost (the API allows up to 1000).
LEDGER_PAGE_SIZE = 1000
# A spec's `prompts` naming an uploaded prompt set (services.domain.prompts.STORE_SCHEME, not imported:
# that module brings the server's backends).
STORE_SCHEME = "store://"
# A Parquet file's first bytes, and its media type for POST /v1/datasets (services.domain.prompts).
PARQUET_MAGIC = b"PAR1"
PARQUET_MEDIA_TYPE = "application/vnd.apache.parquet"


class ClientError(Exception):
    """Something the user must fix before the API can be called (no server, a bad spec file)."""


class ApiError(Exception):
    """The API refused: its status and its ``detail`` as it gave them (a string, or for a 422
    a list of ``{loc, msg, type}``)."""

    def __init__(self, status: int, reason: str, detail: Any) -> None:
        super().__init__(f"{status} {reason}: {detail}")
        self.status = status
        self.reason = reason
        self.detail = detail

    def lines(self) -> list[str]:
        """For people: the status line, then one line per refused field of a 422."""
        if isinstance(self.detail, list):
            fields = [
                f"  {'.'.join(str(p) for p in e.get('loc', []))}: {e.get('msg', '')}"
                if isinstance(e, dict)
                else f"  {e}"
                for e in self.detail
            ]
            return [f"{self.status} {self.reason}", *fields]
        return [f"{self.status} {self.reason}: {self.detail}"]

    def as_json(self) -> dict[str, Any]:
        return {"status": self.status, "detail": self.detail}


class UnreachableError(ClientError):
    """No answer from the server (refused, timed out, not HTTP)."""


# --- where the server and token come from -----------------------------------------------------


def config_path() -> Path:
    if path := os.environ.get("SPOTRL_CONFIG"):
        return Path(path).expanduser()
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "spotrl" / "config.yaml"


def read_config(path: Path | None = None) -> dict[str, str]:
    path = path or config_path()
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, yaml.YAMLError) as e:
        raise ClientError(f"cannot read the config file {path}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ClientError(f"the config file {path} must hold a mapping (server: ..., token: ...)")
    return {k: str(v) for k, v in data.items() if k in ("server", "token") and v is not None}


def write_config(changes: dict[str, str], path: Path | None = None) -> Path:
    """Merge ``changes`` into the config file, written 0600 since it may hold a token."""
    path = path or config_path()
    data = {**read_config(path), **changes}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(data, f, default_flow_style=False)
    os.replace(tmp, path)
    return path


@dataclass(frozen=True)
class Target:
    server: str
    token: str | None


def normalize_server(server: str) -> str:
    server = server.strip().rstrip("/")
    if "://" not in server:
        # A bare host:port: plain HTTP on this machine only, TLS anywhere else.
        host = server.split(":", 1)[0]
        server = ("http://" if host in ("localhost", "127.0.0.1", "[::1]") else "https://") + server
    return server


def resolve_target(server: str | None, token: str | None) -> Target:
    """Flags (and, through typer, the environment) first, then the config file. The file's
    token goes only to the file's server: it is never sent to a server named elsewhere."""
    if server is None or token is None:
        file = read_config()
        server = server or file.get("server")
        if not token and server and file.get("server") and normalize_server(server) == normalize_server(file["server"]):
            token = file.get("token")
    if not server:
        raise ClientError("no API server: pass --server URL, set SPOTRL_SERVER, or run `spotrl config set-server URL`")
    return Target(normalize_server(server), token or None)


# --- the API ------------------------------------------------------------------------------------


class ApiClient:
    """One method per operation of the API; each returns the response's JSON or raises ApiError."""

    def __init__(self, target: Target, *, timeout: float = 30.0, transport: httpx.BaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {target.token}"} if target.token else {}
        self.server = target.server
        self._http = httpx.Client(base_url=target.server, headers=headers, timeout=timeout, transport=transport)

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            r = self._http.request(method, path, **kwargs)
        except httpx.TransportError as e:
            raise UnreachableError(f"cannot reach the API at {self.server}: {e or type(e).__name__}") from None
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except (ValueError, AttributeError):
                detail = r.text.strip() or r.reason_phrase
            raise ApiError(r.status_code, r.reason_phrase, detail)
        return r.json()

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/runs", json=spec)

    def upload_dataset(self, data: bytes, *, fields: dict[str, Any] | None = None) -> dict[str, Any]:
        """Upload a prompt set, JSONL or Parquet (told apart by its first bytes), its rows mapped
        by ``fields`` (a run spec's ``dataset``: prompt_key, answer_key)."""
        media_type = PARQUET_MEDIA_TYPE if data.startswith(PARQUET_MAGIC) else "application/x-ndjson"
        params = {k: v for k, v in (fields or {}).items() if v is not None}
        return self._call("POST", "/v1/datasets", content=data, headers={"Content-Type": media_type}, params=params)

    def list_runs(self, *, page_size: int = DEFAULT_PAGE_SIZE) -> Iterator[dict[str, Any]]:
        """Every run the token sees, oldest first, following the API's page cursor."""
        cursor = None
        while True:
            params: dict[str, Any] = {"limit": page_size, **({"cursor": cursor} if cursor else {})}
            page = self._call("GET", "/v1/runs", params=params)
            yield from page["runs"]
            cursor = page.get("next_cursor")
            if not cursor:
                return

    def get_run(self, run_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/runs/{run_id}")

    def cancel_run(self, run_id: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/runs/{run_id}/cancel")

    def run_cost(self, run_id: str, *, page_size: int = LEDGER_PAGE_SIZE) -> dict[str, Any]:
        """The run's bill with every ledger entry: the first page's figures, and the entries of
        every page, following the API's page cursor."""
        report = self._call("GET", f"/v1/runs/{run_id}/cost", params={"limit": page_size})
        cursor = report.get("next_cursor")
        while cursor:
            page = self._call("GET", f"/v1/runs/{run_id}/cost", params={"limit": page_size, "cursor": cursor})
            report["entries"] += page["entries"]
            cursor = page.get("next_cursor")
        report["next_cursor"] = None
        return report

    def run_pods(self, run_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/runs/{run_id}/pods")

    def pod_log(self, run_id: str, pod: str, *, tail: int) -> dict[str, Any]:
        return self._call("GET", f"/v1/runs/{run_id}/pods/{pod}/logs", params={"tail": tail})


# --- run specs ----------------------------------------------------------------------------------


class _SpecLoader(yaml.SafeLoader):
    """YAML with YAML 1.2's floats: PyYAML (YAML 1.1) reads ``1e-5`` and ``3E2`` as strings, which
    the API, reading a spec strictly, would refuse where a number belongs."""


_SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def read_spec_file(path: Path) -> dict[str, Any]:
    """A run spec file (YAML, or JSON, which YAML reads too) as a mapping. Not validated here:
    the API does that, and its 422 names each field."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ClientError(f"cannot read the run spec {path}: {e.strerror}") from None
    try:
        data = yaml.load(text, Loader=_SpecLoader)  # a SafeLoader: no Python objects
    except yaml.YAMLError as e:
        raise ClientError(f"{path} is neither YAML nor JSON: {e}") from None
    if not isinstance(data, dict):
        raise ClientError(f"{path} must hold a mapping of run spec fields, not {type(data).__name__}")
    return data


def upload_local_prompts(client: ApiClient, spec: dict[str, Any], *, base_dir: Path) -> dict[str, Any] | None:
    """When the spec's ``prompts`` names a JSONL or Parquet file on this machine (relative to the
    spec file), upload it (POST /v1/datasets, its rows mapped by the spec's ``dataset``) and name
    the upload instead; so too its ``eval.prompts``. Returns the upload of ``prompts``.

    A path that is not a file here is left as it is: a path on the server, inside its
    SPOTRL_DATA_DIRS, which the API checks (a directory saved by datasets' save_to_disk too).
    """
    fields = spec.get("dataset") if isinstance(spec.get("dataset"), dict) else None
    dataset = _upload_local(client, spec, fields, base_dir=base_dir)
    if isinstance(spec.get("eval"), dict):
        _upload_local(client, spec["eval"], fields, base_dir=base_dir)
    return dataset


def _upload_local(
    client: ApiClient, section: dict[str, Any], fields: dict[str, Any] | None, *, base_dir: Path
) -> dict[str, Any] | None:
    prompts = section.get("prompts")
    if not isinstance(prompts, str) or prompts.startswith(STORE_SCHEME):
        return None
    path = Path(prompts).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if not path.is_file():
        return None
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ClientError(f"cannot read the prompts {path}: {e.strerror}") from None
    dataset = client.upload_dataset(data, fields=fields)
    section["prompts"] = dataset["uri"]
    return dataset


# --- following logs -----------------------------------------------------------------------------


def new_lines(seen: list[str], current: list[str]) -> list[str]:
    """The lines of ``current`` (a log's tail now) after those of ``seen`` (its tail at the last
    read): after the last place where ``current`` holds the end of ``seen``. A log that grew by
    more than a tail between two reads loses the lines in between; spotrl's pods start each log
    line with a millisecond timestamp, so repeated lines are not taken for one another."""
    if not seen:
        return current
    for i in range(len(current), 0, -1):
        m = min(i, len(seen))
        if current[i - m : i] == seen[-m:]:
            return current[i:]
    return current
