"""The production queue adapter: Apache Kafka through kafka-python.

``KafkaQueue("kafka://host1:9092,host2:9092")`` passes the queue port's contract
(tests/services/backends/test_queue_contract.py) against a real Kafka-protocol broker. What the
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

URL and settings (query parameters, else ``SPOTRL_KAFKA_<NAME>`` environment variables):
``security_protocol`` (PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL), ``ssl_cafile``, ``ssl_certfile``,
``ssl_keyfile``, ``sasl_mechanism`` (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512), ``sasl_plain_username``,
``sasl_plain_password`` (best in the environment: URLs are logged and handed to pods), ``retention_ms``
(topics' retention, default 7 days), ``replication_factor`` (default: the broker's), ``batch_size``
(the producer's ``batch.size`` in bytes, default kafka-python's 16384; 1 sends every record in a
batch of its own, which the test broker needs: tests/servers/kafka.py), ``max_record_bytes`` (the
largest record: the topics' ``max.message.bytes`` and the producer's ``max.request.size``, 16 MiB by
default, as a record holds a GRPO group of samples), and
``session_timeout_min_s``/``session_timeout_max_s``: the range of Kafka session timeouts the brokers
accept (``group.min/max.session.timeout.ms``, 6 s and 30 min by default; a port session timeout
is clamped into ``[min, min(max, 45 s)]`` for Kafka, while the port's own timeout still applies as
above). The password is never logged, shown in a repr, or put in an error message.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import kafka.errors as kafka_errors
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, OffsetSpec
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.coordinator.assignors.abstract import AbstractPartitionAssignor
from kafka.partitioner import murmur2
from kafka.protocol.consumer.metadata import ConsumerProtocolAssignment, ConsumerProtocolSubscription
from kafka.structs import OffsetAndMetadata

from services.backends.queue import CommitFailedError, Consumer, MemberFencedError, Record, UnknownTopicError

log = logging.getLogger(__name__)

_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")
_SCHEME = "kafka"
# Settings a URL query or SPOTRL_KAFKA_* variable may carry, passed to kafka-python as they are.
_SECURITY_KEYS = (
    "security_protocol", "ssl_cafile", "ssl_certfile", "ssl_keyfile",
    "sasl_mechanism", "sasl_plain_username", "sasl_plain_password",
)  # fmt: skip
_OTHER_KEYS = ("retention_ms", "replication_factor", "batch_size", "max_record_bytes", "session_timeout_min_s",
               "session_timeout_max_s")
_SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
_SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
_DEFAULT_RETENTION_MS = 7 * 24 * 3600 * 1000
# Kafka 3's default client session timeout: a dead consumer's partitions move after at most this long.
_DEFAULT_SESSION_MAX_S = 45.0
# Kafka's default group.min.session.timeout.ms.
_DEFAULT_SESSION_MIN_S = 6.0
# How long the background thread's Kafka poll blocks: a caller's commit waits at most this long for it.
_BACKGROUND_POLL_MS = 50
# A commit refused by a rebalance that the background thread has yet to take on is retried this often.
_COMMIT_RETRY_S = 0.05
# Records fetched ahead of the caller's polls, per consumer; fetching pauses beyond this.
_BUFFER_RECORDS = 2000
# A record holds a GRPO group (contracts.samples): n samples of prompt and response tokens and
# log-probs, 8 bytes a response token, so more than Kafka's 1 MB default (16 samples of 8k tokens).
_DEFAULT_MAX_RECORD_BYTES = 16 * 2**20
# Waiting for a topic to appear or vanish in the brokers' metadata after create/delete.
_METADATA_WAIT_S = 30.0
# The assignor's name: every member of a group must offer it (they all run this adapter).
_ASSIGNOR = "spotrl-v1"


@dataclass(frozen=True)
class KafkaSettings:
    """Where the brokers are and how to reach them; parsed from a ``kafka://`` URL and the environment."""

    bootstrap_servers: list[str]
    security: dict[str, str] = field(default_factory=dict, repr=False)  # kafka-python's security settings
    retention_ms: int = _DEFAULT_RETENTION_MS  # topics' retention.ms
    replication_factor: int = -1  # -1: the brokers' default.replication.factor
    session_timeout_min_s: float = _DEFAULT_SESSION_MIN_S  # the brokers' group.min.session.timeout.ms
    session_timeout_max_s: float = _DEFAULT_SESSION_MAX_S  # at most the brokers' group.max.session.timeout.ms
    batch_size: int | None = None  # the producer's batch.size in bytes; None: kafka-python's default
    max_record_bytes: int = _DEFAULT_MAX_RECORD_BYTES  # topics' max.message.bytes, the producer's max request

    @classmethod
    def from_url(cls, url: str, env: Mapping[str, str] | None = None) -> KafkaSettings:
        env = os.environ if env is None else env
        parts = urlsplit(url)
        if parts.scheme != _SCHEME or not parts.netloc:
            raise ValueError(f"a Kafka queue URL looks like kafka://host:9092[,host2:9092], got {redact(url)!r}")
        if "@" in parts.netloc:
            raise ValueError(
                "a Kafka queue URL carries no credentials: set SPOTRL_KAFKA_SASL_PLAIN_USERNAME and"
                " SPOTRL_KAFKA_SASL_PLAIN_PASSWORD (or the query parameters of the same names)"
            )
        servers = [s.strip() for s in parts.netloc.split(",") if s.strip()]
        query: dict[str, str] = {}
        for name, value in parse_qsl(parts.query, keep_blank_values=True):
            if name not in _SECURITY_KEYS + _OTHER_KEYS:
                raise ValueError(
                    f"unknown Kafka queue URL parameter {name!r}; known: {', '.join(_SECURITY_KEYS + _OTHER_KEYS)}"
                )
            query[name] = value
        values = {k: query.get(k, env.get(f"SPOTRL_KAFKA_{k.upper()}")) for k in _SECURITY_KEYS + _OTHER_KEYS}
        security = {k: v for k in _SECURITY_KEYS if (v := values[k])}
        protocol = security.setdefault("security_protocol", "PLAINTEXT").upper()
        if protocol not in _SECURITY_PROTOCOLS:
            raise ValueError(f"security_protocol must be one of {', '.join(_SECURITY_PROTOCOLS)}, got {protocol!r}")
        security["security_protocol"] = protocol
        if protocol.startswith("SASL_"):
            mechanism = security.get("sasl_mechanism", "").upper()
            if mechanism not in _SASL_MECHANISMS:
                raise ValueError(
                    f"security_protocol {protocol} needs sasl_mechanism, one of {', '.join(_SASL_MECHANISMS)}"
                )
            security["sasl_mechanism"] = mechanism
            missing = [k for k in ("sasl_plain_username", "sasl_plain_password") if k not in security]
            if missing:
                raise ValueError(
                    f"sasl_mechanism {mechanism} needs {' and '.join(missing)}"
                    f" (SPOTRL_KAFKA_{'/'.join(m.upper() for m in missing)})"
                )
        numbers = {
            "retention_ms": (int, _DEFAULT_RETENTION_MS),
            "replication_factor": (int, -1),
            "batch_size": (int, None),
            "max_record_bytes": (int, _DEFAULT_MAX_RECORD_BYTES),
            "session_timeout_min_s": (float, _DEFAULT_SESSION_MIN_S),
            "session_timeout_max_s": (float, _DEFAULT_SESSION_MAX_S),
        }
        parsed: dict[str, Any] = {}
        for name, (kind, default) in numbers.items():
            raw = values[name]
            try:
                parsed[name] = default if raw in (None, "") else kind(raw)
            except ValueError:
                raise ValueError(f"Kafka setting {name} must be a number, got {raw!r}") from None
        if parsed["session_timeout_min_s"] <= 0 or parsed["session_timeout_max_s"] < parsed["session_timeout_min_s"]:
            raise ValueError("Kafka session_timeout_min_s must be positive and at most session_timeout_max_s")
        if parsed["max_record_bytes"] < 1024:
            raise ValueError(f"Kafka max_record_bytes must be at least 1024, got {parsed['max_record_bytes']}")
        if parsed["batch_size"] is not None and parsed["batch_size"] < 1:
            raise ValueError(f"Kafka batch_size must be at least 1 byte, got {parsed['batch_size']}")
        return cls(bootstrap_servers=servers, security=security, **parsed)

    def client_config(self) -> dict[str, Any]:
        """Connection settings common to every kafka-python client (the password masked in reprs:
        kafka-python logs its configuration at debug level)."""
        config: dict[str, Any] = {"bootstrap_servers": self.bootstrap_servers, **self.security}
        if "sasl_plain_password" in config:
            config["sasl_plain_password"] = _Secret(config["sasl_plain_password"])
        return config


class _Secret(str):
    """A string that does not show itself in a repr (so neither in a logged dict of settings);
    kafka-python reads its characters (join, encode) as usual."""

    def __repr__(self) -> str:
        return "'***'"


def redact(url: str) -> str:
    """``url`` with any password parameter's value replaced, for messages and logs."""
    return re.sub(r"(sasl_plain_password=)[^&]*", r"\1***", url, flags=re.IGNORECASE)


def _partition_for_key(key: bytes, partitions: int) -> int:
    # murmur2 as Kafka's Java client and kafka-python's DefaultPartitioner compute it, so that any
    # producer of the same topic puts a key in the same partition.
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def _group_id(topic: str, group: str) -> str:
    # ':' never appears in a topic name, so a topic's groups are exactly those starting "<topic>:".
    return f"{topic}:{group}"


class KafkaUnavailableError(ConnectionError):
    """A Kafka client could not be set up (brokers unreachable, TLS or SASL refused); the message
    never holds the password."""


class _SpotrlAssignor(AbstractPartitionAssignor):
    """The group leader's assignment: fencing by port member id, and partitions dealt round-robin.

    Each member's subscription user data is ``{"member", "created", "live"}``: its port member id,
    when its consumer was created (ns since the epoch) and whether its caller polled within the
    port's session timeout. It changes only when ``live`` does, so rejoining members present the
    same subscription and a rebalance takes one round. For example, after a rollout worker
    restarts as the same ``worker-0`` while the old process still heartbeats:

    1. members ``A`` (``worker-0``, created t1, owns p0..p3) and ``B`` (``worker-0``, created t2 > t1);
    2. ``B`` is the newest of ``worker-0``: it gets p0..p3, and ``A``'s assignment says ``fenced``;
       ``A`` raises MemberFencedError from then on and leaves the group;
    3. the rebalance after ``A`` left gives ``B`` p0..p3 again.

    Partitions are dealt over the live members sorted by port member id (over all of them when none
    is live), as the embedded adapter deals them. Each member's assignment also carries its Kafka
    member id (``you``) and the port ids of the group (``roster``).
    """

    name = _ASSIGNOR
    version = 0

    def __init__(self, consumer: _KafkaConsumer) -> None:
        self._consumer = consumer

    def metadata(self, topics):  # noqa: ANN001, ANN201 - kafka-python's signature
        return ConsumerProtocolSubscription(self.version, sorted(topics), self._consumer.subscription_data())

    def on_assignment(self, assignment, generation):  # noqa: ANN001, ANN201
        self._consumer.on_assignment(assignment, generation)

    def assign(self, cluster, members):  # noqa: ANN001, ANN201
        parsed: dict[str, tuple[str, int, bool, set[str]]] = {}
        for member in members:
            try:
                data = json.loads(bytes(member.metadata.user_data or b"{}"))
            except ValueError:
                data = {}
            parsed[member.member_id] = (
                str(data.get("member", member.member_id)),
                int(data.get("created", 0)),
                bool(data.get("live", True)),
                set(member.metadata.topics),
            )
        newest: dict[str, str] = {}  # port member id -> Kafka member id of its newest consumer
        for kafka_id, (port_id, created, _live, _topics) in parsed.items():
            best = newest.get(port_id)
            if best is None or (created, kafka_id) > (parsed[best][1], best):
                newest[port_id] = kafka_id
        winners = set(newest.values())
        live = sorted((parsed[k][0], k) for k in winners if parsed[k][2])
        eligible = live or sorted((parsed[k][0], k) for k in winners)
        assigned: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
        for topic in sorted({t for *_head, topics in parsed.values() for t in topics}):
            subscribers = [k for _, k in eligible if topic in parsed[k][3]]
            for i, partition in enumerate(sorted(cluster.partitions_for_topic(topic) or ())):
                if subscribers:
                    assigned[subscribers[i % len(subscribers)]][topic].append(partition)
        roster = sorted(parsed[k][0] for k in winners)
        return {
            kafka_id: ConsumerProtocolAssignment(
                self.version,
                sorted(assigned[kafka_id].items()),
                json.dumps({"you": kafka_id, "fenced": kafka_id not in winners, "roster": roster}).encode(),
            )
            for kafka_id in parsed
        }


class _Listener(ConsumerRebalanceListener):
    """Forwards kafka-python's rebalance callbacks (run on its IO thread) to the consumer."""

    def __init__(self, consumer: _KafkaConsumer) -> None:
        self._consumer = consumer

    def on_partitions_revoked(self, revoked):  # noqa: ANN001, ANN201
        self._consumer.on_revoked(lost=False)

    def on_partitions_lost(self, lost):  # noqa: ANN001, ANN201
        self._consumer.on_revoked(lost=True)

    def on_partitions_assigned(self, assigned):  # noqa: ANN001, ANN201
        self._consumer.on_assigned()


class _KafkaConsumer:
    """A port consumer: a kafka-python group member driven by a background thread.

    The background thread owns the kafka-python consumer (which is not thread-safe; the caller's
    commits take the same lock) and keeps it polling: heartbeats, rebalances and fetches go on
    while the caller works. Fetched records wait in a bounded buffer for the caller's ``poll``.

    State shared between the threads, under ``_cond``:
    ``_current`` the partitions of the latest completed assignment and their ownership tokens
    (``on_assignment``), kept through a rebalance and dropped when the membership is lost;
    ``_snapshot`` those at the caller's last poll (``assignment()``), against which commits are checked;
    ``_positions`` the next offset the caller has not been given, per partition of ``_snapshot``;
    ``_rewind`` partitions to be read again from the group's committed offset (the background
    thread seeks there): kafka-python keeps its own fetch position for a partition it keeps
    through a rebalance, past records the caller was given or the buffer dropped, so "restart from
    the commit" takes a seek.
    """

    def __init__(
        self,
        settings: KafkaSettings,
        client_config: Mapping[str, Any],
        topic: str,
        group: str,
        *,
        member_id: str,
        session_timeout_s: float,
        partitions: int,
        join_timeout_s: float,
        client: Callable[[Callable[[], Any]], Any],
        on_close: Callable[[_KafkaConsumer], None],
    ) -> None:
        """Join ``group`` on ``topic`` and wait for the first assignment. Longer than a function
        should be because it declares the consumer's whole state in one place (the class docstring
        says what guards what), before the Kafka client and the background thread that use it."""
        self._topic = topic
        self._partitions = partitions
        self._group = group
        self._member_id = member_id
        self._session_timeout_s = session_timeout_s
        self._join_timeout_s = join_timeout_s
        self._on_close = on_close
        self._errors_logged: set[str] = set()
        self._created_ns = time.time_ns()
        self._cond = threading.Condition()
        self._kafka_lock = threading.Lock()
        self._buffer: list[Record] = []
        self._current: dict[int, str] = {}
        self._pending: dict[int, str] | None = None  # tokens of an assignment being installed
        self._snapshot: dict[int, str] = {}
        self._positions: dict[int, int] = {}
        self._rewind: set[int] = set()
        self._roster: list[str] = []
        self._kafka_member = ""  # this member's Kafka member id and generation, from the last assignment
        self._generation = -1
        self._callers = 0  # caller threads inside consumer() or poll(): a waiting caller is polling
        self._rebalancing = True
        self._assignments = 0  # completed assignments, so waiters can tell a new one arrived
        self._fenced = False
        self._left = False  # left the group after the port session lapsed; the next poll rejoins
        self._closed = False
        self._failure: BaseException | None = None
        self._last_poll = time.monotonic()
        kafka_session_ms = int(1000 * min(max(session_timeout_s, settings.session_timeout_min_s), settings.session_timeout_max_s))
        # A rebalance completes within the rebalance timeout (here Kafka's session timeout) unless
        # the brokers are unreachable: poll and commit wait that long for one under way.
        self._rebalance_wait_s = kafka_session_ms / 1000 + 5.0
        self._kafka: KafkaConsumer = client(lambda: KafkaConsumer(
            **client_config,
            client_id=f"spotrl-{member_id}",
            group_id=_group_id(topic, group),
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            allow_auto_create_topics=False,
            session_timeout_ms=kafka_session_ms,
            heartbeat_interval_ms=max(100, min(3000, kafka_session_ms // 4)),
            # Our thread polls every _BACKGROUND_POLL_MS, so this only trips if the process stalls.
            max_poll_interval_ms=kafka_session_ms,
            partition_assignment_strategy=[_SpotrlAssignor(self)],
        ))
        self._kafka.subscribe([topic], listener=_Listener(self))
        self._thread = threading.Thread(target=self._run, name=f"kafka-consumer-{member_id}", daemon=True)
        try:
            with self._calling():
                self._thread.start()
                self._wait_joined(0)
                with self._cond:
                    self._adopt()
        except BaseException:
            self.close()
            raise

    # -- the port -------------------------------------------------------------------------

    def poll(self, max_records: int, timeout_s: float) -> list[Record]:
        if max_records < 1:
            raise ValueError(f"max_records must be at least 1, got {max_records}")
        self._check_usable()
        with self._calling():
            return self._poll(max_records, timeout_s)

    def _poll(self, max_records: int, timeout_s: float) -> list[Record]:
        with self._cond:
            rejoin = self._left
        if rejoin:  # polls rejoin a group that this member left when its session lapsed
            with self._kafka_lock:
                self._kafka.subscribe([self._topic], listener=_Listener(self))
                with self._cond:
                    start, self._rebalancing, self._left = self._assignments, True, False
                    self._cond.notify_all()
            self._wait_joined(start)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                # A rebalance under way revokes every partition (Kafka's eager protocol): wait for
                # it rather than report an empty assignment.
                self._wait_rebalanced(max(self._rebalance_wait_s, deadline - time.monotonic()))
                self._adopt()
                records = self._take(max_records)
                remaining = deadline - time.monotonic()
                if records or remaining <= 0:
                    return records
                self._cond.wait(remaining)
                self._raise_if_failed()

    def commit(self, offsets: Mapping[int, int]) -> None:
        self._check_usable()
        offsets = dict(offsets)
        with self._cond:
            self._wait_rebalanced(self._rebalance_wait_s)
            unknown = sorted(set(offsets) - set(range(self._partitions)))
            if unknown or any(o < 0 for o in offsets.values()):
                raise ValueError(
                    f"cannot commit offsets {offsets} for topic {self._topic!r}: partitions {unknown} do not exist"
                    " or an offset is negative; commit next_offsets(records) of records this consumer polled"
                )
            lost = sorted(p for p in offsets if self._current.get(p) is None or self._current[p] != self._snapshot.get(p))
            self._adopt()
        if lost:
            raise CommitFailedError(
                f"member {self._member_id!r} of group {self._group!r} no longer owns partitions {lost} of topic"
                f" {self._topic!r} (the group rebalanced, e.g. after a {self._session_timeout_s} s session timeout"
                " without a poll); nothing was committed and the new owner gets those records again"
            )
        if not offsets:
            return
        request = {TopicPartition(self._topic, p): OffsetAndMetadata(o, "", -1) for p, o in offsets.items()}
        deadline = time.monotonic() + self._rebalance_wait_s
        while True:
            try:
                with self._kafka_lock:
                    self._kafka.commit(request)
                return
            except kafka_errors.FencedInstanceIdError as e:
                raise MemberFencedError(self._fenced_message()) from e
            except (
                kafka_errors.CommitFailedError,
                kafka_errors.RebalanceInProgressError,
                kafka_errors.IllegalGenerationError,
                kafka_errors.UnknownMemberIdError,
            ) as e:
                # The group began rebalancing after the check above (or dropped this member).
                # Partitions this member keeps throughout (same tokens) are still its to commit
                # (refused, their records would come to nobody again: this member reads on past
                # them): try again, in the new generation, once the rebalance is done. A partition
                # that changed hands meanwhile fails the commit; its new holder reads it from the
                # last commit.
                with self._cond:
                    if self._fenced:
                        raise MemberFencedError(self._fenced_message()) from e
                    kept = all(self._current.get(p) is not None and self._current[p] == self._snapshot.get(p)
                               for p in offsets)  # fmt: skip
                    if not kept or time.monotonic() > deadline:
                        raise CommitFailedError(
                            f"member {self._member_id!r} of group {self._group!r} could not commit partitions"
                            f" {sorted(offsets)} of topic {self._topic!r}: the group rebalanced ({type(e).__name__});"
                            " nothing was committed and the new owner gets those records again"
                        ) from e
                    # Let the background thread take the rebalance on (it needs the Kafka lock).
                    self._cond.wait(_COMMIT_RETRY_S)
                    self._wait_rebalanced(max(0.0, deadline - time.monotonic()))

    def assignment(self) -> set[int]:
        with self._cond:
            return set(self._snapshot)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        with self._kafka_lock:
            # A dynamic member leaves the group here (LeaveGroup with its own Kafka member id), so
            # its partitions go to the others now; a fenced consumer cannot evict its successor.
            self._kafka.close(autocommit=False)
        with self._cond:
            self._buffer, self._snapshot, self._current, self._positions = [], {}, {}, {}
        self._on_close(self)

    # -- called by kafka-python (its IO thread) ---------------------------------------------

    def subscription_data(self) -> bytes:
        with self._cond:
            live = self._live()
        return json.dumps({"member": self._member_id, "created": self._created_ns, "live": live}).encode()

    def on_assignment(self, assignment: ConsumerProtocolAssignment, generation: int) -> None:
        """Compute the ownership tokens of a new assignment (installed by ``on_assigned``).

        A partition keeps its token if this member held it in the assignment just before, under
        the same Kafka member id: every member takes part in every generation of its group, so
        nobody else can have held it in between. Otherwise (gained, regained, a generation missed,
        kicked out and back) it gets a new token, and commits of what was read before fail.
        """
        try:
            data = json.loads(bytes(assignment.user_data or b"{}"))
        except ValueError:
            data = {}
        me = str(data.get("you", ""))
        partitions = [p for _, parts in assignment.assigned_partitions for p in parts]
        with self._cond:
            continuing = me == self._kafka_member and generation == self._generation + 1
            self._pending = {
                p: self._current[p] if continuing and p in self._current else f"{me}@{generation}" for p in partitions
            }
            self._kafka_member, self._generation = me, generation
            self._roster = list(data.get("roster") or [])
            if data.get("fenced"):
                self._fenced = True
                log.warning("consumer %r of group %r on %r was replaced by a newer one with its member id (fenced)",
                            self._member_id, self._group, self._topic)
            self._cond.notify_all()

    def on_revoked(self, *, lost: bool) -> None:
        with self._cond:
            self._rebalancing = True
            self._buffer = []  # positions restart from the commit, or from the caller's position below
            if lost:
                # Kicked out of the group (e.g. the process stalled past Kafka's session timeout):
                # whatever it is given next, someone else may have held in between.
                self._current, self._generation = {}, -1
            self._cond.notify_all()

    def on_assigned(self) -> None:
        with self._cond:
            tokens, self._pending = self._pending or {}, None
            for partition, token in tokens.items():
                position = self._positions.get(partition)
                if position is not None and self._snapshot.get(partition) == token and partition not in self._rewind:
                    # Owned without a break since the caller's last poll: carry on where the caller
                    # is, not from the commit, so that nothing it was given comes again.
                    self._kafka.seek(TopicPartition(self._topic, partition), position)
                else:
                    # Gained, regained, or nothing given to the caller yet: from the commit. Not
                    # kafka-python's own position, which it keeps for a partition it held before,
                    # past what the caller was given and what the revocation dropped from the buffer.
                    self._rewind.add(partition)
            self._rewind &= set(tokens)
            self._current = tokens
            self._rebalancing = False
            self._assignments += 1
            self._cond.notify_all()

    # -- the background thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._step():
                pass
        except BaseException as e:  # noqa: BLE001 - handed to the caller's next call
            with self._cond:
                self._failure = e
                self._cond.notify_all()
            if not isinstance(e, Exception):
                raise

    def _step(self) -> bool:
        """One round of the background thread; False once the consumer is closed."""
        with self._cond:
            if self._closed:
                return False
            if self._left:  # out of the group until the caller polls again
                self._cond.wait(0.5)
                return True
            leave = self._fenced or self._session_lapsed()
            room = _BUFFER_RECORDS - len(self._buffer)
        if leave:
            with self._kafka_lock:
                self._kafka.unsubscribe()  # LeaveGroup: the other members take the partitions now
            with self._cond:
                self._current, self._buffer, self._rebalancing, self._left = {}, [], False, True
                self._generation = -1
                self._cond.notify_all()
            return True
        with self._cond:
            rewind = set(self._rewind) if not self._rebalancing else set()
        if rewind:
            self._rewind_to_committed(rewind)
        with self._kafka_lock:
            assigned = self._kafka.assignment()
            paused = self._kafka.paused()
            if room <= 0 and assigned - paused:
                self._kafka.pause(*(assigned - paused))  # the caller is behind: stop fetching, keep heartbeating
            elif room > 0 and paused:
                self._kafka.resume(*paused)
            try:
                batches = self._kafka.poll(timeout_ms=_BACKGROUND_POLL_MS, max_records=max(1, room))
            except kafka_errors.KafkaError as e:
                error: kafka_errors.KafkaError | None = e
                batches = {}
            else:
                error = None
        if error is not None:
            # Brokers down or metadata in flux: kafka-python recovers by itself; log each kind once.
            if type(error).__name__ not in self._errors_logged:
                self._errors_logged.add(type(error).__name__)
                log.warning("consumer %r of %r: %s (retrying)", self._member_id, self._topic, error)
            time.sleep(0.5)
        if batches:
            self._deliver(batches)
        return True

    def _live(self) -> bool:
        """Whether the caller is polling: inside a call, or out of one for less than the session timeout."""
        return self._callers > 0 or time.monotonic() - self._last_poll <= self._session_timeout_s

    def _session_lapsed(self) -> bool:
        """Whether the caller's port session just lapsed with other members in the group, which
        then take its partitions; alone, the member keeps them (called under ``_cond``)."""
        if self._live() or self._rebalancing:
            return False
        others = [m for m in self._roster if m != self._member_id]
        if others:
            log.info("member %r of group %r on %r did not poll for %.1f s: leaving the group to %s",
                     self._member_id, self._group, self._topic, self._session_timeout_s, others)
        return bool(others)

    def _rewind_to_committed(self, partitions: set[int]) -> None:
        """Seek ``partitions`` back to the group's committed offsets (the start where none is),
        and forget what was fetched of them before (background thread)."""
        done: set[int] = set()
        try:
            with self._kafka_lock:
                assigned = {tp.partition for tp in self._kafka.assignment()}
                for partition in sorted(partitions & assigned):
                    tp = TopicPartition(self._topic, partition)
                    committed = self._kafka.committed(tp, timeout_ms=int(self._rebalance_wait_s * 1000))
                    if committed is None or committed < 0:
                        self._kafka.seek_to_beginning(tp)  # auto_offset_reset="earliest", as for a first read
                    else:
                        self._kafka.seek(tp, committed)
                    done.add(partition)
        except kafka_errors.KafkaError as e:  # brokers unreachable: the next round tries again
            if type(e).__name__ not in self._errors_logged:
                self._errors_logged.add(type(e).__name__)
                log.warning("consumer %r of %r: %s (retrying)", self._member_id, self._topic, e)
            time.sleep(0.5)
        with self._cond:
            self._rewind -= done
            self._buffer = [r for r in self._buffer if r.partition not in done]
            for partition in done:
                self._positions.pop(partition, None)

    def _deliver(self, batches: Mapping[TopicPartition, list[Any]]) -> None:
        with self._cond:
            if self._rebalancing:
                return
            for tp, messages in batches.items():
                if tp.partition not in self._current or tp.partition in self._rewind:
                    continue  # not ours, or fetched from before the seek to the commit
                self._buffer.extend(
                    Record(tp.topic, tp.partition, m.offset, m.key, m.value, m.timestamp / 1000.0) for m in messages
                )
            self._cond.notify_all()

    # -- helpers (under _cond unless said) -------------------------------------------------------

    @contextlib.contextmanager
    def _calling(self) -> Iterator[None]:
        """A caller inside consumer() or poll() counts as polling for the whole call (not under _cond)."""
        with self._cond:
            self._callers += 1
        try:
            yield
        finally:
            with self._cond:
                self._callers -= 1
                self._last_poll = time.monotonic()

    def _adopt(self) -> None:
        """The caller sees the current assignment: a partition gained or regained restarts from the commit."""
        for partition in list(self._positions):
            if self._current.get(partition) != self._snapshot.get(partition) or partition not in self._current:
                del self._positions[partition]
        self._snapshot = dict(self._current)

    def _take(self, max_records: int) -> list[Record]:
        taken: list[Record] = []
        keep: list[Record] = []
        for record in self._buffer:
            if record.partition not in self._snapshot:
                keep.append(record)  # cannot happen: _take follows _adopt, and rebalances empty the buffer
                continue
            if record.offset < self._positions.get(record.partition, 0):
                continue  # already given (a fetch that raced a seek)
            if len(taken) < max_records:
                taken.append(record)
                self._positions[record.partition] = record.offset + 1
            else:
                keep.append(record)
        self._buffer = keep
        return taken

    def _wait_rebalanced(self, timeout_s: float) -> None:
        """Wait for a rebalance under way to finish (at most ``timeout_s``): during one, Kafka's
        eager protocol has revoked every partition, so there is nothing to report yet."""
        self._cond.wait_for(lambda: not self._rebalancing or self._fenced or self._failure, timeout_s)
        self._raise_if_failed()

    def _wait_joined(self, start: int) -> None:
        """Wait until an assignment later than the ``start``-th one has been installed."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: (self._assignments > start and not self._rebalancing) or self._failure or self._closed,
                self._join_timeout_s,
            )
            self._raise_if_failed()
            if not ok:
                raise TimeoutError(
                    f"consumer {self._member_id!r} could not join group {self._group!r} of topic {self._topic!r}"
                    f" within {self._join_timeout_s} s; are the Kafka brokers reachable?"
                )

    def _check_usable(self) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError(f"consumer {self._member_id!r} is closed; open a new one with Queue.consumer")
            self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._fenced:
            raise MemberFencedError(self._fenced_message())
        if self._failure is not None:
            raise RuntimeError(f"consumer {self._member_id!r} of topic {self._topic!r} failed") from self._failure

    def _fenced_message(self) -> str:
        return (
            f"another consumer joined group {self._group!r} of topic {self._topic!r} as member"
            f" {self._member_id!r} and took over its partitions; close this consumer"
        )


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
        self._consumers: set[_KafkaConsumer] = set()
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
            "configs": {"retention.ms": str(self.settings.retention_ms),
                        "max.message.bytes": str(self.settings.max_record_bytes)},
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
        groups = [g["group_id"] for g in self._admin.list_groups() if str(g.get("group_id", "")).startswith(f"{topic}:")]
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
        # by produce time (services.training.backlog.take_batch) see one call's records together.
        now_ms = int(time.time() * 1000)
        futures = [
            producer.send(topic, value=value, key=key, partition=partition, timestamp_ms=now_ms)
            for value, key, partition in zip(values, keys if keys is not None else [None] * len(values), chosen)
        ]
        producer.flush()
        for future in futures:
            future.get(timeout=0)  # raises the record's delivery error, if any

    def consumer(self, topic: str, group: str, *, member_id: str, session_timeout_s: float = 10.0) -> Consumer:
        if session_timeout_s <= 0:
            raise ValueError(f"session_timeout_s must be positive, got {session_timeout_s}")
        consumer = _KafkaConsumer(
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
        group_id = _group_id(topic, group)
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
