"""The Kafka consumer's group protocol hooks: the fencing assignor and the rebalance listener.

Both are handed to kafka-python by ``services.ports.queue.kafka_consumer.KafkaGroupConsumer`` and
forward to it: the assignor (run by the group leader) fences members replaced under the same port
member id and deals partitions round-robin; the listener passes revocations and assignments on.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any, Protocol

from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.coordinator.assignors.abstract import AbstractPartitionAssignor
from kafka.protocol.consumer.metadata import ConsumerProtocolAssignment, ConsumerProtocolSubscription


class GroupMember(Protocol):
    """What the hooks forward to: the consumer that joined the group (``KafkaGroupConsumer``)."""

    def subscription_data(self) -> bytes: ...

    def on_assignment(self, assignment: Any, generation: int) -> None: ...

    def on_revoked(self, *, lost: bool) -> None: ...

    def on_assigned(self) -> None: ...


# The assignor's name: every member of a group must offer it (they all run this adapter).
ASSIGNOR = "spotrl-v1"


class SpotrlAssignor(AbstractPartitionAssignor):
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

    name = ASSIGNOR
    version = 0

    def __init__(self, consumer: GroupMember) -> None:
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


class RebalanceListener(ConsumerRebalanceListener):
    """Forwards kafka-python's rebalance callbacks (run on its IO thread) to the consumer."""

    def __init__(self, consumer: GroupMember) -> None:
        self._consumer = consumer

    def on_partitions_revoked(self, revoked):  # noqa: ANN001, ANN201
        self._consumer.on_revoked(lost=False)

    def on_partitions_lost(self, lost):  # noqa: ANN001, ANN201
        self._consumer.on_revoked(lost=True)

    def on_partitions_assigned(self, assigned):  # noqa: ANN001, ANN201
        self._consumer.on_assigned()
