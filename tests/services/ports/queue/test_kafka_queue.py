"""What the Kafka adapter promises beyond the queue contract (test_queue_contract.py runs that
against the same broker): delivery settings, topic settings, a broker stall during produce,
settings and secrets, the partitioner, and the trainer's backlog read on Kafka.

The broker is tansu (tests/servers/kafka.py); see that module for its two workarounds."""

from __future__ import annotations

import logging
import threading
import time
import traceback
import uuid
from collections import Counter
from pathlib import Path

import pytest
from kafka import KafkaConsumer, TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient
from kafka.partitioner import DefaultPartitioner

from contracts.samples import Sample, decode_group, encode_group
from services.domain.backlog import read_backlog, take_batch, trainer_consumer
from services.domain.names import TRAINER_GROUP, samples_topic
from services.ports.queue.kafka_queue import KafkaQueue, KafkaUnavailableError, _partition_for_key
from services.ports.queue.kafka_settings import KafkaSettings
from services.ports.wiring import open_queue
from tests.servers.kafka import KafkaBroker


@pytest.fixture
def queue(kafka_broker: KafkaBroker):
    q = kafka_broker.open_queue()
    yield q
    q.close()


def new_topic(queue: KafkaQueue, partitions: int = 2) -> str:
    topic = f"k-{uuid.uuid4().hex[:12]}"
    queue.create_topic(topic, partitions)
    return topic


def read_all(broker: KafkaBroker, topic: str, partitions: int, want: int, timeout_s: float = 30.0) -> list[bytes]:
    """Every record of ``topic`` from the start, read by a plain consumer outside any group."""
    consumer = KafkaConsumer(bootstrap_servers=broker.bootstrap, enable_auto_commit=False)
    consumer.assign([TopicPartition(topic, p) for p in range(partitions)])
    consumer.seek_to_beginning()
    values: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < want and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=200).values():
                values += [r.value for r in records]
        # A little longer: duplicates would arrive after the count was reached.
        for records in consumer.poll(timeout_ms=500).values():
            values += [r.value for r in records]
    finally:
        consumer.close()
    return values


def test_the_producer_is_idempotent_and_waits_for_all_replicas(queue: KafkaQueue) -> None:
    topic = new_topic(queue)
    queue.produce(topic, [b"x"])
    config = queue._get_producer().config  # as the running producer has it, after kafka-python's own checks
    assert config["enable_idempotence"] is True
    assert config["acks"] == -1  # "all"
    assert config["retries"] > 0
    with pytest.raises(ValueError, match="fixed by the queue port"):
        KafkaQueue(queue.settings, producer_config={"acks": 1})


def test_topics_are_created_with_their_retention(kafka_broker: KafkaBroker) -> None:
    queue = kafka_broker.open_queue("retention_ms=3600000")
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker.bootstrap)
    try:
        topic = new_topic(queue, partitions=3)
        described = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)], config_filter="all")
        assert described["topic"][topic]["retention.ms"]["value"] == "3600000"
        (info,) = admin.describe_topics([topic])
        assert len(info["partitions"]) == 3
        queue.create_topic(topic, 3)  # again: success, nothing changes
        queue.delete_topic(topic)
        assert topic not in admin.list_topics()
    finally:
        admin.close()
        queue.close()
    assert KafkaSettings.from_url("kafka://h:9092", env={}).retention_ms == 7 * 24 * 3600 * 1000


def test_produce_rides_out_a_broker_stall_without_loss_or_duplicates(kafka_broker: KafkaBroker) -> None:
    """The broker stops answering (SIGSTOP) for 3 s in the middle of a produce. Requests time out
    after 1 s and may be retried (kafka-python either resends a timed-out batch, or holds it until
    the connection answers: which, depends on timing, so the test does not insist); whatever it
    did, the idempotent producer's records are written once, and produce returns only after the
    broker is back and has acknowledged every record."""
    queue = kafka_broker.open_queue(producer_config={"request_timeout_ms": 1000, "retry_backoff_ms": 100})
    try:
        topic = new_topic(queue)
        ids = [f"sample-{i}".encode() for i in range(600)]
        queue.produce(topic, ids[:100])  # connected and warm before the stall
        resumed_at: list[float] = []

        def stall() -> None:
            time.sleep(0.05)
            with kafka_broker.paused():
                time.sleep(3.0)
            resumed_at.append(time.monotonic())

        staller = threading.Thread(target=stall)
        staller.start()
        for start in range(100, 600, 50):  # produce calls in flight while the broker is stopped
            queue.produce(topic, ids[start : start + 50])
        returned_at = time.monotonic()
        staller.join()

        assert resumed_at and returned_at >= resumed_at[0], "produce returned before the broker could acknowledge"
        counts = Counter(read_all(kafka_broker, topic, 2, want=len(ids)))
        assert set(counts) == set(ids), f"lost {len(set(ids) - set(counts))} records"
        assert max(counts.values()) == 1, f"duplicated {sum(c > 1 for c in counts.values())} records"
        assert sum(queue.end_offsets(topic).values()) == len(ids)
    finally:
        queue.close()


def test_no_password_in_errors_reprs_or_logs(
    kafka_broker: KafkaBroker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    secret = f"pw-{uuid.uuid4().hex}"
    monkeypatch.setenv("SPOTRL_KAFKA_SASL_PLAIN_PASSWORD", secret)
    url = f"{kafka_broker.url}?security_protocol=SASL_PLAINTEXT&sasl_mechanism=SCRAM-SHA-512&sasl_plain_username=spotrl"
    settings = KafkaSettings.from_url(url)
    assert settings.security["sasl_plain_password"] == secret  # from the environment
    assert secret not in repr(settings) and secret not in repr(settings.client_config())

    caplog.set_level(logging.DEBUG)  # kafka-python logs its whole configuration at debug level
    with pytest.raises(KafkaUnavailableError) as raised:
        KafkaQueue(url, connect_timeout_s=2.0)  # the test broker has no SASL: the handshake fails
    text = "".join(traceback.format_exception(raised.value))
    assert "cannot connect" in text and "SASL_PLAINTEXT" in text
    assert secret not in text
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
    assert secret not in caplog.text
    assert "sasl_plain_password" in caplog.text  # the configuration was logged, with the password masked

    # A password in the URL (not recommended) stays out of messages about that URL too.
    with pytest.raises(ValueError) as bad:
        KafkaSettings.from_url(f"kafka://h:9092?sasl_plain_password={secret}&bogus=1", env={})
    assert secret not in str(bad.value)
    with pytest.raises(ValueError) as bad:
        KafkaSettings.from_url(f"kafkax://h:9092?sasl_plain_password={secret}", env={})
    assert secret not in str(bad.value)


def test_settings_from_the_url_and_the_environment() -> None:
    env = {
        "SPOTRL_KAFKA_SECURITY_PROTOCOL": "sasl_ssl",
        "SPOTRL_KAFKA_SASL_MECHANISM": "SCRAM-SHA-256",
        "SPOTRL_KAFKA_SASL_PLAIN_USERNAME": "u",
        "SPOTRL_KAFKA_SASL_PLAIN_PASSWORD": "p",
        "SPOTRL_KAFKA_SSL_CAFILE": "/etc/ca.pem",
        "SPOTRL_KAFKA_RETENTION_MS": "1000",
    }
    settings = KafkaSettings.from_url("kafka://b1:9092,b2:9093?retention_ms=2000&replication_factor=3", env=env)
    assert settings.bootstrap_servers == ["b1:9092", "b2:9093"]
    assert settings.security == {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-256",
        "sasl_plain_username": "u",
        "sasl_plain_password": "p",
        "ssl_cafile": "/etc/ca.pem",
    }
    assert (settings.retention_ms, settings.replication_factor) == (2000, 3)  # the URL wins over the environment
    assert KafkaSettings.from_url("kafka://b:9092", env={}).security == {"security_protocol": "PLAINTEXT"}
    for url, message in [
        ("kafka://b:9092?security_protocol=SASL_SSL", "sasl_mechanism"),
        ("kafka://b:9092?security_protocol=SASL_SSL&sasl_mechanism=PLAIN", "sasl_plain_username"),
        ("kafka://b:9092?security_protocol=TLS", "security_protocol"),
        ("kafka://b:9092?retention_ms=soon", "retention_ms"),
        ("kafka://b:9092?linger_ms=5", "unknown"),
        ("kafka://user:pw@b:9092", "no credentials"),
        ("kafka://", "kafka://host:9092"),
    ]:
        with pytest.raises(ValueError, match=message):
            KafkaSettings.from_url(url, env={})


def test_open_queue_chooses_the_adapter_by_url(kafka_broker: KafkaBroker, tmp_path: Path) -> None:
    queue = open_queue(kafka_broker.url, tmp_path)
    try:
        assert isinstance(queue, KafkaQueue)
        assert queue.settings.bootstrap_servers == [kafka_broker.bootstrap]
    finally:
        queue.close()
    with pytest.raises(ValueError, match="kafka://"):
        open_queue("redis://127.0.0.1:6379/0", tmp_path)


def test_keys_are_partitioned_as_other_kafka_clients_do(queue: KafkaQueue) -> None:
    """murmur2 as the Java client and kafka-python's default partitioner compute it, so a key lands
    in the same partition whichever client produced it."""

    class Cluster:
        def topics(self):  # noqa: ANN201
            return {"t"}

        def partitions_for_topic(self, topic):  # noqa: ANN001, ANN201
            return set(range(7))

        def available_partitions_for_topic(self, topic):  # noqa: ANN001, ANN201
            return set(range(7))

    keys = [f"group-{i}".encode() for i in range(200)]
    assert [_partition_for_key(k, 7) for k in keys] == [
        DefaultPartitioner().partition("t", k, k, b"", b"", Cluster()) for k in keys
    ]
    topic = new_topic(queue, partitions=7)
    queue.produce(topic, [b"v"] * len(keys), keys=keys)
    consumer = queue.consumer(topic, "g", member_id="m")
    got = []
    while len(got) < len(keys):
        got += consumer.poll(500, timeout_s=1.0)
    assert all(r.partition == _partition_for_key(r.key, 7) for r in got)


def test_a_deleted_topic_takes_its_groups_offsets_with_it(queue: KafkaQueue) -> None:
    topic = new_topic(queue)
    queue.produce(topic, [b"a", b"b", b"c", b"d"])
    consumer = queue.consumer(topic, "g", member_id="m")
    consumer.commit({0: 1, 1: 1})
    consumer.close()
    assert queue.committed(topic, "g") == {0: 1, 1: 1}
    queue.delete_topic(topic)
    queue.create_topic(topic, 2)
    assert queue.committed(topic, "g") == {0: 0, 1: 0}
    assert queue.backlog(topic, "g") == 0


def sample(run_id: str, group: int, i: int, tokens: int = 256) -> Sample:
    return Sample(
        sample_id=uuid.uuid4().hex,
        run_id=run_id,
        prompt_id=f"p{group}",
        group_id=f"g{group}",
        prompt_ids=list(range(64)),
        response_ids=list(range(tokens)),
        logprobs=[-0.5] * tokens,
        reward=float(i % 2),
        reward_source="rule",
        policy_version=0,
        worker_id="w0",
        generation_seconds=1.0,
        created_at=time.time(),
    )


def test_the_training_job_reads_and_commits_its_batch_on_kafka(queue: KafkaQueue) -> None:
    """The trainer's own path (services.domain.backlog) on Kafka: groups of samples, one record
    each keyed by the group, as rollout workers queue them, read as a backlog, taken, committed."""
    run_id = f"r{uuid.uuid4().hex[:8]}"
    topic = samples_topic(run_id)
    queue.create_topic(topic, 4)
    groups = [[sample(run_id, g, i) for i in range(4)] for g in range(6)]
    queue.produce(topic, [encode_group(g) for g in groups], keys=[g[0].group_id.encode() for g in groups])
    assert queue.backlog(topic, TRAINER_GROUP) == 6

    consumer = trainer_consumer(queue, run_id)
    try:
        records, _ = read_backlog(queue, consumer, run_id)
        batch, offsets = take_batch(records, groups=2)
        decoded = [s for r in batch for s in decode_group(r.value)]
        assert len(decoded) == 8 and len({s.group_id for s in decoded}) == 2
        assert {s.sample_id for s in decoded} <= {s.sample_id for g in groups for s in g}
        consumer.commit(offsets)
    finally:
        consumer.close()
    assert queue.backlog(topic, TRAINER_GROUP) == 4
    queue.delete_topic(topic)
