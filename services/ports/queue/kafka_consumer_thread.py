"""The Kafka consumer's background thread: keeps the kafka-python consumer polling.

``ConsumerThread`` is a part of ``services.ports.queue.kafka_consumer.KafkaGroupConsumer`` (its only
subclass), kept apart for size: the state it reads and writes is the consumer's, declared in its
``__init__``, and the consumer's docstring says which lock guards what. The thread heartbeats,
takes rebalances on, leaves the group when the caller's port session lapses, seeks partitions back
to the group's commit and fills the consumer's bounded buffer with fetched records.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import kafka.errors as kafka_errors
from kafka import TopicPartition

from services.ports.queue.queue import Record

# The consumer's logger: these are its messages.
log = logging.getLogger("services.ports.queue.kafka_consumer")

# How long the background thread's Kafka poll blocks: a caller's commit waits at most this long for it.
_BACKGROUND_POLL_MS = 50
# Records fetched ahead of the caller's polls, per consumer; fetching pauses beyond this.
_BUFFER_RECORDS = 2000


class ConsumerThread:
    """The background thread's side of ``KafkaGroupConsumer`` (which starts ``_run`` on its thread)."""

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
            log.info(
                "member %r of group %r on %r did not poll for %.1f s: leaving the group to %s",
                self._member_id,
                self._group,
                self._topic,
                self._session_timeout_s,
                others,
            )
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
