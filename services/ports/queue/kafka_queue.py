"""The production queue adapter: Apache Kafka through kafka-python.

``KafkaQueue("kafka://host1:9092,host2:9092")`` passes the queue port's contract
(tests/services/ports/queue/test_queue_contract.py) against a real Kafka-protocol broker. What the
port asks for and how Kafka gives it:

- **Topics** are created with the run (``create_topic``: partitions, replication factor and
  ``retention.ms``; an existing topic with the same partitions is success) and deleted after it.
- **Produce** uses an idempotent producer with ``acks=all``: ``produce`` returns once every record
  is acknowledged by all in-sync replicas, and a retried request after a broker stall or a lost
  connection is written once. The adapter picks each record's partition itself: murmur2 of the
  key, as Kafka's Java and kafka-python default partitioners do (so other clients agree), and a
  round-robin counter for keyless records (the default partitioners pick a random or a "sticky"
  partition instead, which the port does not allow).
- **Groups** are Kafka consumer groups with manual commits of explicit offsets
  (``enable_auto_commit=False``). A port group is per topic, as in the embedded adapter, so the
  Kafka group id is ``<topic>:<group>`` (``<run>.samples:trainer``): runs never rebalance each
  other, and deleting a run's topic deletes its groups.
- **Membership** follows the port rather than kafka-python's poll loop: a background thread per
  consumer polls Kafka, so heartbeats go on and rebalances complete while the caller is busy
  (generating samples, training); the caller's ``poll`` takes records from that thread. The port's
  session timeout is enforced here: a member whose caller has not polled for it gives its
  partitions to the group's other members (it leaves the group); alone, it keeps them, and a late
  commit succeeds. Kafka's own session timeout only detects a dead process.
- **Fencing** (a restarted member replacing its predecessor) is done by the group's assignor, not
  by Kafka static membership: each member states its port member id and the time it was created in
  its subscription, and the leader gives a member id's partitions to its newest consumer and tells
  the older ones they are fenced. Static membership (``group.instance.id``) was the other choice;
  it is not used because (1) a static member never sends LeaveGroup (kafka-python, like the Java
  client), so ``close`` could not hand partitions over at once as the port requires, and (2) the
  test broker (tansu 0.6) gives a second static consumer the same member id as the first instead
  of fencing it, so fencing could not be tested there.
- **Commit safety**: the assignor stamps every partition with an ownership token, kept while the
  same member keeps the partition and replaced whenever it changes hands. A commit is refused
  (``CommitFailedError``, nothing stored) for any partition whose token differs from the one at
  the caller's last poll: the partition moved to another member since the records were read, even
  if it has moved back. Kafka's generation check on the commit itself stays as the last guard: a
  commit it refuses because the group began rebalancing meanwhile is tried again once the
  rebalance is done, if the member kept the partitions throughout (the port fails a commit only
  for a partition that changed hands). A partition that changed hands, even back to this member,
  is read again from the group's last commit: the consumer seeks there itself, since kafka-python
  keeps its own fetch position for a partition it holds across a rebalance.
- **Offsets**: ``end_offsets`` are ListOffsets(latest) (the high watermark), ``committed`` are the
  group's OffsetFetch, ``backlog`` is their difference.

Membership, fencing and commit safety are the consumer's: ``services.ports.queue.kafka_consumer``.

URL and settings: ``services.ports.queue.kafka_settings``.
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import kafka.errors as kafka_errors
from kafka import KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, OffsetSpec
from kafka.partitioner import murmur2

from services.ports.queue.kafka_consumer import KafkaGroupConsumer, kafka_group_id
from services.ports.queue.kafka_settings import KafkaSettings
from services.ports.queue.queue import Consumer, UnknownTopicError

log = logging.getLogger(__name__)

_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")
# Waiting for a topic to appear or vanish in the brokers' metadata after create/delete.
_METADATA_WAIT_S = 30.0


def _partition_for_key(key: bytes, partitions: int) -> int:
    # murmur2 as Kafka's Java client and kafka-python's DefaultPartitioner compute it, so that any
    # producer of the same topic puts a key in the same partition.
    return (murmur2(key) & 0x7FFFFFFF) % partitions


class KafkaUnavailableError(ConnectionError):
    """A Kafka client could not be set up (brokers unreachable, TLS or SASL refused); the message
    never holds the password."""


class KafkaQueue:
    """The queue port on Kafka brokers (module docstring).

    ``connect_timeout_s``: how long a client tries to reach the brokers before giving up
    (``KafkaUnavailableError``). ``producer_config`` and ``consumer_join_timeout_s`` are for tests
    and benchmarks: extra kafka-python producer settings (``batch_size``, ``linger_ms``,
    ``request_timeout_ms``; the delivery guarantees ``acks`` and ``enable_idempotence`` cannot be
    changed) and how long ``consumer()`` waits for its first assignment.
    """

    def __init__(
        self,
        url: str | KafkaSettings,
        *,
        connect_timeout_s: float = 30.0,
        producer_config: Mapping[str, Any] | None = None,
        consumer_join_timeout_s: float = 120.0,
    ) -> None:
        self.settings = url if isinstance(url, KafkaSettings) else KafkaSettings.from_url(url)
        self._client_config = {**self.settings.client_config(), "bootstrap_timeout_ms": int(connect_timeout_s * 1000)}
        fixed = {"acks", "enable_idempotence", "partitioner"}
        if producer_config and fixed & set(producer_config):
            raise ValueError(f"producer settings {sorted(fixed & set(producer_config))} are fixed by the queue port")
        batching = {} if self.settings.batch_size is None else {"batch_size": self.settings.batch_size}
        self._producer_config = {**batching, **(producer_config or {})}
        self._join_timeout_s = consumer_join_timeout_s
        self._consumers: set[KafkaGroupConsumer] = set()
        self._lock = threading.Lock()
        self._round_robin: dict[str, int] = {}
        self._producer: KafkaProducer | None = None
        self._admin = self._client(lambda: KafkaAdminClient(**self._client_config, client_id="spotrl-admin"))

    def __repr__(self) -> str:
        return f"KafkaQueue({','.join(self.settings.bootstrap_servers)!r})"

    # -- topics -----------------------------------------------------------------------------

    def create_topic(self, topic: str, partitions: int) -> None:
        if not _TOPIC_NAME.fullmatch(topic):
            raise ValueError(f"topic name {topic!r} is invalid: use 1-249 of the characters A-Z a-z 0-9 . _ -")
        if partitions < 1:
            raise ValueError(f"a topic needs at least one partition, got {partitions}")
        spec = {
            "num_partitions": partitions,
            "replication_factor": self.settings.replication_factor,
            "configs": {
                "retention.ms": str(self.settings.retention_ms),
                "max.message.bytes": str(self.settings.max_record_bytes),
            },
        }
        deadline = time.monotonic() + _METADATA_WAIT_S
        while True:
            try:
                self._admin.create_topics({topic: spec})
                break
            except kafka_errors.TopicAlreadyExistsError:
                existing = self._partitions(topic, missing_ok=True)
                if existing is None:
                    # Still being deleted (Kafka deletes asynchronously): try again shortly.
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
                    continue
                if len(existing) != partitions:
                    raise ValueError(
                        f"topic {topic!r} already exists with {len(existing)} partitions, not {partitions}:"
                        " delete it first or ask for the same number"
                    ) from None
                return
        self._admin.wait_for_topics([topic], timeout_ms=int(_METADATA_WAIT_S * 1000))

    def delete_topic(self, topic: str) -> None:
        try:
            self._admin.delete_topics([topic])
        except kafka_errors.UnknownTopicOrPartitionError:
            return
        # The topic's groups go with it (their offsets would otherwise apply to a new topic of the
        # same name); Kafka drops the offsets of a deleted topic itself, this removes the groups.
        groups = [
            g["group_id"] for g in self._admin.list_groups() if str(g.get("group_id", "")).startswith(f"{topic}:")
        ]
        if groups:
            try:
                self._admin.delete_groups(groups)
            except kafka_errors.KafkaError as e:  # a group with live members stays; its offsets are gone
                log.info("could not delete the groups %s of deleted topic %r: %s", groups, topic, e)
        deadline = time.monotonic() + _METADATA_WAIT_S
        while self._partitions(topic, missing_ok=True) is not None and time.monotonic() < deadline:
            time.sleep(0.1)

    # -- records ------------------------------------------------------------------------------

    def produce(self, topic: str, values: Sequence[bytes], *, keys: Sequence[bytes | None] | None = None) -> None:
        if keys is not None and len(keys) != len(values):
            raise ValueError(f"got {len(keys)} keys for {len(values)} values; pass one key per value, or none")
        for value in values:
            if not isinstance(value, bytes):
                raise TypeError(f"record values must be bytes, got {type(value).__name__}; encode them first")
        partitions = len(self._partitions(topic))
        if not values:
            return
        producer = self._get_producer()
        with self._lock:
            start = self._round_robin.setdefault(topic, random.randrange(partitions))
            keyless = 0
            chosen = []
            for key in keys if keys is not None else [None] * len(values):
                if key is None:
                    chosen.append((start + keyless) % partitions)
                    keyless += 1
                else:
                    chosen.append(_partition_for_key(key, partitions))
            self._round_robin[topic] = (start + keyless) % partitions
        # One timestamp for the whole call, as the embedded adapter stamps it: readers that order
        # by produce time (services.domain.backlog.take_batch) see one call's records together.
        now_ms = int(time.time() * 1000)
        futures = [
            producer.send(topic, value=value, key=key, partition=partition, timestamp_ms=now_ms)
            for value, key, partition in zip(
                values, keys if keys is not None else [None] * len(values), chosen, strict=True
            )
        ]
        producer.flush()
        for future in futures:
            future.get(timeout=0)  # raises the record's delivery error, if any

    def consumer(self, topic: str, group: str, *, member_id: str, session_timeout_s: float = 10.0) -> Consumer:
        if session_timeout_s <= 0:
            raise ValueError(f"session_timeout_s must be positive, got {session_timeout_s}")
        consumer = KafkaGroupConsumer(
            self.settings,
            self._client_config,
            topic,
            group,
            member_id=member_id,
            session_timeout_s=session_timeout_s,
            partitions=len(self._partitions(topic)),
            join_timeout_s=self._join_timeout_s,
            client=self._client,
            on_close=self._consumers.discard,
        )
        self._consumers.add(consumer)
        return consumer

    # -- offsets ------------------------------------------------------------------------------

    def end_offsets(self, topic: str) -> dict[int, int]:
        partitions = self._partitions(topic)
        latest = self._admin.list_partition_offsets({TopicPartition(topic, p): OffsetSpec.LATEST for p in partitions})
        return {tp.partition: found.offset for tp, found in latest.items()}

    def committed(self, topic: str, group: str) -> dict[int, int]:
        partitions = self._partitions(topic)
        group_id = kafka_group_id(topic, group)
        stored = self._admin.list_group_offsets({group_id: [TopicPartition(topic, p) for p in partitions]})
        offsets = {tp.partition: meta.offset for tp, meta in stored.get(group_id, {}).items()}
        return {p: max(offsets.get(p, 0), 0) for p in partitions}  # -1: never committed

    def backlog(self, topic: str, group: str) -> int:
        end = self.end_offsets(topic)
        committed = self.committed(topic, group)
        return sum(end[p] - committed.get(p, 0) for p in end)

    def close(self) -> None:
        for consumer in list(self._consumers):
            consumer.close()
        if self._producer is not None:
            self._producer.close()
            self._producer = None
        self._admin.close()

    # -- helpers ------------------------------------------------------------------------------

    def _partitions(self, topic: str, *, missing_ok: bool = False) -> list[int] | None:
        """The topic's partitions from the brokers' metadata; UnknownTopicError if it does not exist."""
        (described,) = self._admin.describe_topics([topic])
        error = kafka_errors.for_code(described.get("error_code", 0))
        if error is kafka_errors.UnknownTopicOrPartitionError:
            if missing_ok:
                return None
            raise UnknownTopicError(f"topic {topic!r} does not exist: create it with create_topic first")
        if error is not kafka_errors.NoError:
            raise error(f"describing topic {topic!r} failed")
        return sorted(p["partition_index"] for p in described.get("partitions") or ())

    def _get_producer(self) -> KafkaProducer:
        with self._lock:
            if self._producer is None:
                self._producer = self._client(
                    lambda: KafkaProducer(
                        **self._client_config,
                        client_id="spotrl-producer",
                        acks="all",
                        enable_idempotence=True,
                        allow_auto_create_topics=False,
                        max_request_size=self.settings.max_record_bytes,
                        **self._producer_config,
                    )
                )
            return self._producer

    def _client(self, make: Callable[[], Any]) -> Any:
        """Build a kafka-python client; its errors are re-raised with any password scrubbed out."""
        secret = self.settings.security.get("sasl_plain_password")
        try:
            return make()
        except Exception as e:
            message = f"{type(e).__name__}: {e}"
            if secret:
                message = message.replace(secret, "***")
            # `from None`: the original exception (and its traceback's locals) may hold the password.
            raise KafkaUnavailableError(
                f"cannot connect to Kafka brokers {','.join(self.settings.bootstrap_servers)}"
                f" ({self.settings.security.get('security_protocol')}): {message}"
            ) from None
