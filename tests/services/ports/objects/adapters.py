"""The object store adapters that port-wide tests run against: the embedded one and S3 on a real
(moto) server. Production adapters join ADAPTERS."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from services.ports.objects.local_object_store import LocalObjectStore
from services.ports.objects.object_store import ObjectStore
from services.ports.objects.s3_object_store import S3ObjectStore

# adapter name -> (the test's request, for a server fixture; a folder for its state) -> a client.
# Called twice in a test, it gives two clients of the same store.
ADAPTERS: dict[str, Callable[[pytest.FixtureRequest, Path], ObjectStore]] = {
    "local": lambda request, root: LocalObjectStore(root / "objects"),
    "s3": lambda request, root: S3ObjectStore.from_url(request.getfixturevalue("s3_bucket").url),  # tests/servers/s3.py
}
