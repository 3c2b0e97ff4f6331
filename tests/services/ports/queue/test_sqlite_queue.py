"""SqliteQueue across OS processes: concurrent producers, and a consumer killed with SIGKILL."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from itertools import pairwise
from pathlib import Path

from services.ports.queue.queue import Record, next_offsets
from services.ports.queue.sqlite_queue import SqliteQueue

# Opens the queue, says so, and produces once the parent says go (a line on stdin), so both overlap.
PRODUCER = """
import sys, time
from pathlib import Path
from services.ports.queue.sqlite_queue import SqliteQueue

queue = SqliteQueue(Path(sys.argv[1]))
tag, n = sys.argv[2], int(sys.argv[3])
print("ready", flush=True)
sys.stdin.readline()
for start in range(0, n, 5):
    queue.produce("t", [f"{tag}-{i}".encode() for i in range(start, start + 5)])
    time.sleep(0.002)  # a producer's own work between batches, which lets the other one in
queue.close()
"""

# Joins the group, reads everything it is given, commits nothing, says so, and waits to be killed.
# Its session outlasts the kill and the survivor's join on a busy machine (the survivor checks that
# the dead member still holds its partitions).
CONSUMER = """
import sys, time
from pathlib import Path
from services.ports.queue.sqlite_queue import SqliteQueue

consumer = SqliteQueue(Path(sys.argv[1])).consumer("t", "g", member_id="a-doomed", session_timeout_s=5.0)
got = []
while len(got) < int(sys.argv[2]):
    got += consumer.poll(100, timeout_s=0.5)
print(len(got), flush=True)
time.sleep(60)
"""


def test_concurrent_producer_processes_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    path = tmp_path / "queue.db"
    queue = SqliteQueue(path)
    queue.create_topic("t", 3)
    producers = [
        subprocess.Popen(
            [sys.executable, "-c", PRODUCER, str(path), tag, "300"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for tag in ("p1", "p2")
    ]
    for p in producers:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
    for p in producers:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.close()
    assert [p.wait(timeout=60) for p in producers] == [0, 0]

    consumer = queue.consumer("t", "g", member_id="m")
    got: list[Record] = []
    while batch := consumer.poll(1000, timeout_s=0):
        got += batch
    values = [r.value for r in got]
    assert len(values) == len(set(values)) == 600
    assert set(values) == {f"{tag}-{i}".encode() for tag in ("p1", "p2") for i in range(300)}
    for partition, end in queue.end_offsets("t").items():  # offsets are dense: no gap, no reuse
        in_log_order = sorted((r for r in got if r.partition == partition), key=lambda r: r.offset)
        assert [r.offset for r in in_log_order] == list(range(end))
        writers = [r.value.split(b"-")[0] for r in in_log_order]
        assert sum(a != b for a, b in pairwise(writers)) > 2, "the producers did not overlap"
    queue.close()


def test_a_sigkilled_consumers_records_go_to_another_member_after_its_session(tmp_path: Path) -> None:
    path = tmp_path / "queue.db"
    queue = SqliteQueue(path)
    queue.create_topic("t", 4)
    queue.produce("t", [f"v{i}".encode() for i in range(20)])
    doomed = subprocess.Popen([sys.executable, "-c", CONSUMER, str(path), "20"], stdout=subprocess.PIPE, text=True)
    assert doomed.stdout is not None
    assert doomed.stdout.readline().strip() == "20"
    doomed.kill()
    doomed.wait()

    survivor = queue.consumer("t", "g", member_id="b-survivor", session_timeout_s=1.0)
    assert survivor.assignment() == {1, 3}  # the dead member still counts until its session times out
    got: list[Record] = []
    deadline = time.monotonic() + 30
    while len(got) < 20:
        assert time.monotonic() < deadline, f"only {len(got)} of 20 records came back"
        got += survivor.poll(100, timeout_s=0.2)
    survivor.commit(next_offsets(got))

    assert sorted(r.value for r in got) == sorted(f"v{i}".encode() for i in range(20))
    assert survivor.assignment() == {0, 1, 2, 3}
    assert queue.backlog("t", "g") == 0
    queue.close()


def test_threads_can_share_one_queue(tmp_path: Path) -> None:
    queue = SqliteQueue(tmp_path / "queue.db")
    queue.create_topic("t", 2)
    consumer = queue.consumer("t", "g", member_id="m")
    got: list[Record] = []

    def consume() -> None:
        while len(got) < 200:
            got.extend(consumer.poll(50, timeout_s=0.1))

    reader = threading.Thread(target=consume)
    reader.start()
    for start in range(0, 200, 10):
        queue.produce("t", [f"v{i}".encode() for i in range(start, start + 10)])
    reader.join(timeout=30)

    assert not reader.is_alive()
    assert sorted(r.value for r in got) == sorted(f"v{i}".encode() for i in range(200))
    queue.close()
