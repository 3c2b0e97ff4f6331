"""Headless Chromium (Debian's package) for the report page's test.

``python -m tests.servers.chromium`` (run by ``make test``) makes sure the browser is there:
``chromium`` on PATH is used as it is; otherwise Debian's ``chromium`` and those of its
dependencies that the machine lacks are fetched with ``apt-get download`` and unpacked with
``dpkg-deb -x`` into a cache folder outside the repo (``$SPOTRL_CHROMIUM_CACHE``, default
``~/.cache/spotrl/chromium``): no root, nothing installed system-wide, and a second run finds the
binary and does nothing. The unpacked libraries are found through ``LD_LIBRARY_PATH``
(``chromium_env``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from tests.servers.debian import unpack_packages

CACHE = Path(os.environ.get("SPOTRL_CHROMIUM_CACHE", Path.home() / ".cache" / "spotrl" / "chromium"))
PACKAGE = "chromium"
# The flags TEST-INFRA.md measured on these machines (no sandbox without root, no GPU).
HEADLESS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run")
_CACHED_BINARY = CACHE / "usr" / "lib" / "chromium" / "chromium"
_LIB_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu/pulseaudio", "lib/x86_64-linux-gnu")


def find_chromium() -> Path | None:
    """The chromium binary: on PATH, or unpacked in the cache; None when neither."""
    on_path = shutil.which("chromium")
    if on_path:
        return Path(on_path)
    return _CACHED_BINARY if os.access(_CACHED_BINARY, os.X_OK) else None


def chromium_env() -> dict[str, str]:
    """The environment to run the found binary in: the cache's libraries ahead of the system's."""
    libs = [str(CACHE / d) for d in _LIB_DIRS if (CACHE / d).is_dir()]
    current = os.environ.get("LD_LIBRARY_PATH")
    return {**os.environ, "LD_LIBRARY_PATH": ":".join([*libs, *([current] if current else [])])}


def _installed(package: str) -> bool:
    r = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True)
    return r.returncode == 0 and "install ok installed" in r.stdout


def _hard_dependencies(package: str) -> list[str]:
    """The first alternative of each Depends/PreDepends of ``package`` (real packages only)."""
    out = subprocess.run(
        [
            "apt-cache",
            "depends",
            "--no-recommends",
            "--no-suggests",
            "--no-conflicts",
            "--no-breaks",
            "--no-replaces",
            "--no-enhances",
            package,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    deps, alternative = [], False
    for line in out.splitlines():
        m = re.match(r"\s+(\|)?(?:Pre)?Depends: (<)?([^\s>]+)", line)
        if m is None:
            continue
        if not alternative and m.group(2) is None:  # a virtual package (<name>) is left to its providers
            deps.append(m.group(3))
        alternative = m.group(1) is not None  # "|Depends:" means the next line is an alternative to this one
    return deps


def missing_packages(roots: Iterable[str]) -> list[str]:
    """``roots`` and, transitively, their hard dependencies that dpkg does not list as installed."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        package = todo.pop()
        if package in seen or _installed(package):
            continue
        seen.add(package)
        todo.extend(_hard_dependencies(package))
    return sorted(seen)


def ensure_chromium() -> Path:
    """The chromium binary, fetched from Debian's archive and unpacked into the cache if absent."""
    found = find_chromium()
    if found is not None:
        return found
    unpack_packages(missing_packages([PACKAGE]), CACHE)
    found = find_chromium()
    if found is None:
        raise RuntimeError(f"Debian's {PACKAGE} package unpacked into {CACHE} has no usr/lib/chromium/chromium")
    return found


def headless(binary: Path, url: str, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """Run headless Chromium on ``url`` with ``args`` (``--dump-dom``, ``--screenshot=...``)."""
    return subprocess.run(
        [str(binary), *HEADLESS, *args, url],
        env=chromium_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=True,
    )


if __name__ == "__main__":
    print(ensure_chromium())
    sys.exit(0)
