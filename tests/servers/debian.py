"""Debian packages for the test servers, unpacked rather than installed: ``apt-get download``
then ``dpkg-deb -x`` into a cache folder outside the repo. No root, nothing installed
system-wide, nothing started as a service."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path


def unpack_packages(packages: Sequence[str], into: Path) -> None:
    """Download ``packages`` from the machine's Debian archive and unpack each into ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=into) as download:
        subprocess.run(["apt-get", "download", *packages], cwd=download, check=True)
        for deb in sorted(Path(download).glob("*.deb")):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(into)], check=True)
