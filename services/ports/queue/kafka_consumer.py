"""The Kafka adapter's consumer: one port group member, driven by a background thread.

``services.ports.queue.kafka_queue`` says how the port's groups, membership, fencing and commit
safety map onto Kafka consumer groups; this module is that part of the adapter: ``KafkaQueue``
creates a ``KafkaGroupConsumer`` per ``consumer`` call. Its background thread is in
``kafka_consumer_thread``; the group's assignor and rebalance listener in ``kafka_rebalance``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import kafka.errors as kafka_errors
from kafka import KafkaConsumer, TopicPartition
from kafka.protocol.consumer.metadata import ConsumerProtocolAssignment
from kafka.structs import OffsetAndMetadata

from services.ports.queue.kafka_consumer_thread import ConsumerThread
from services.ports.queue.kafka_rebalance import RebalanceListener, SpotrlAssignor
from services.ports.queue.queue import CommitFailedError, MemberFencedError, Record

if TYPE_CHECKING:
    from services.ports.queue.kafka_settings import KafkaSettings

log = logging.getLogger(__name__)

# A commit refused by a rebalance that the background thread has yet to take on is retried this often.
_COMMIT_RETRY_S = 0.05


def kafka_group_id(topic: str, group: str) -> str:
    # ':' never appears in a topic name, so a topic's groups are exactly those starting "<topic>:".
    return f"{topic}:{group}"


class KafkaGroupConsumer(ConsumerThread):
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
        on_close: Callable[[KafkaGroupConsumer], None],
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
        kafka_session_ms = int(
            1000 * min(max(session_timeout_s, settings.session_timeout_min_s), settings.session_timeout_max_s)
        )
        # A rebalance completes within the rebalance timeout (here Kafka's session timeout) unless
        # the brokers are unreachable: poll and commit wait that long for one under way.
        self._rebalance_wait_s = kafka_session_ms / 1000 + 5.0
        self._kafka: KafkaConsumer = client(
            lambda: KafkaConsumer(
                **client_config,
                client_id=f"spotrl-{member_id}",
                group_id=kafka_group_id(topic, group),
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                allow_auto_create_topics=False,
                session_timeout_ms=kafka_session_ms,
                heartbeat_interval_ms=max(100, min(3000, kafka_session_ms // 4)),
                # Our thread polls every _BACKGROUND_POLL_MS, so this only trips if the process stalls.
                max_poll_interval_ms=kafka_session_ms,
                partition_assignment_strategy=[SpotrlAssignor(self)],
            )
        )
        self._kafka.subscribe([topic], listener=RebalanceListener(self))
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
                self._kafka.subscribe([self._topic], listener=RebalanceListener(self))
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
            lost = sorted(
                p for p in offsets if self._current.get(p) is None or self._current[p] != self._snapshot.get(p)
            )
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
                    kept = all(
                        self._current.get(p) is not None and self._current[p] == self._snapshot.get(p) for p in offsets
                    )
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
                log.warning(
                    "consumer %r of group %r on %r was replaced by a newer one with its member id (fenced)",
                    self._member_id,
                    self._group,
                    self._topic,
                )
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
