"""OrderedProducer against the real broker: PUB-1..PUB-4 and PUB-6."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, wait
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME, KafkaError, Producer
from confluent_kafka import Message as KafkaMessage
from confluent_kafka.admin import AdminClient

from ordering_layer import Admin, OrderedProducer, PublishResult
from ordering_layer.errors import (
    ConfigError,
    InvalidMessageError,
    InvalidOrderingKeyError,
    MessageTooLargeError,
    OrderingKeyPausedError,
    PublishError,
    TopicError,
)
from ordering_layer.record import HEADER_MESSAGE_ID, HEADER_PARTITION_COUNT
from ordering_layer.stack import StackBackend
from tests.checker import wait_until
from tests.kafka_helpers import end_offsets, headers_of, read_topic

pytestmark = pytest.mark.integration


def test_in_key_order_many_keys_and_partitions(kafka_config: dict[str, Any],
                                               topic_factory: Callable[..., str]) -> None:
    """PUB-1: one producer's messages of a key are stored in publish order, in one partition,
    the partition Kafka's default (murmur2) partitioner picks."""
    topic = topic_factory(partitions=4)
    keys = [f"customer-{i}" for i in range(50)]
    futures: list[Future[PublishResult]] = []
    with OrderedProducer(kafka_config) as producer:
        for n in range(60):
            for key in keys:
                futures.append(producer.publish(topic, f"{key}:{n}".encode(), ordering_key=key))
    results = [f.result(timeout=30) for f in futures]
    records = read_topic(kafka_config, topic, len(results))
    assert len(records) == len(results)

    seen: dict[str, list[int]] = defaultdict(list)
    partitions: dict[str, set[int]] = defaultdict(set)
    for record in sorted(records, key=lambda r: (r.partition(), r.offset())):
        key = record.key().decode()
        seen[key].append(int(record.value().decode().split(":")[1]))
        partitions[key].add(record.partition())
    assert all(seen[key] == list(range(60)) for key in keys)
    assert all(len(partitions[key]) == 1 for key in keys)

    # The same keys through librdkafka's murmur2_random partitioner land in the same partitions.
    raw = Producer({**kafka_config, "partitioner": "murmur2_random"})
    landed: dict[bytes, int] = {}

    def record_partition(err: KafkaError | None, msg: KafkaMessage) -> None:
        landed[msg.key()] = msg.partition()

    for key in keys:
        raw.produce(topic, b"probe", key=key.encode(), on_delivery=record_partition)
    raw.flush(30)
    assert landed == {key.encode(): next(iter(partitions[key])) for key in keys}


def test_publish_result_identity(kafka_config: dict[str, Any], topic_factory: Callable[..., str]) -> None:
    """PUB-3: each publish resolves to message id, sequence number, partition, offset, enqueued time."""
    topic = topic_factory(partitions=3)
    before = datetime.now(UTC) - timedelta(seconds=5)
    with OrderedProducer(kafka_config) as producer:
        futures = [producer.publish(topic, b"x", ordering_key=f"k{i % 7}") for i in range(300)]
        futures.append(producer.publish(topic, b"unordered"))
        futures.append(producer.publish(topic, b"chosen id", ordering_key="k0", message_id="order-17"))
        results = [f.result(timeout=30) for f in futures]
    after = datetime.now(UTC) + timedelta(seconds=5)

    assert len({r.message_id for r in results}) == len(results)
    records = read_topic(kafka_config, topic, len(results))
    by_position = {(r.partition(), r.offset()): r for r in records}
    for result in results:
        assert result.sequence_number == (result.partition << 48) | result.offset
        assert result.sequence_number >> 48 == result.partition
        assert result.sequence_number & ((1 << 48) - 1) == result.offset
        record = by_position[(result.partition, result.offset)]
        if result.message_id == "order-17":
            assert headers_of(record)[HEADER_MESSAGE_ID] == b"order-17"
        else:  # PUB-6: no id header; the id is the decimal sequence number
            assert HEADER_MESSAGE_ID not in headers_of(record)
            assert result.message_id == str(result.sequence_number)
        kind, stamp = record.timestamp()
        assert kind == TIMESTAMP_LOG_APPEND_TIME
        assert result.enqueued_time == datetime.fromtimestamp(stamp / 1000, tz=UTC)
        assert before <= result.enqueued_time <= after


def test_plain_records_and_partition_count_stamp(admin: Admin, kafka_config: dict[str, Any],
                                                 topic_factory: Callable[..., str]) -> None:
    """PUB-6: a plain consumer reads key = ordering key, value = payload, headers = attributes; the
    partition count used to route each record is stamped, also after partitions are added."""
    topic = topic_factory(partitions=2)
    assert admin.describe_topic(topic).timestamp_type == "LogAppendTime"
    with OrderedProducer(kafka_config, settings={"metadata_max_age": 0.5}) as producer:
        first = [producer.publish(topic, b"before", ordering_key=f"k{i}", attributes={"phase": "1"})
                 for i in range(20)]
        wait(first, timeout=30)
        admin.add_partitions(topic, 5)
        deadline = time.monotonic() + 30
        later: list[Future[PublishResult]] = []
        while time.monotonic() < deadline:
            later = [producer.publish(topic, b"after", ordering_key=f"k{i}", attributes={"phase": "2"})
                     for i in range(20)]
            wait(later, timeout=30)
            if max(f.result().partition for f in later) >= 2:
                break
    records = read_topic(kafka_config, topic, sum(end_offsets(kafka_config, topic).values()))
    stamps: dict[bytes, set[int]] = {}
    for record in records:
        headers = headers_of(record)
        count = int(headers[HEADER_PARTITION_COUNT])
        stamps[record.value()] = stamps.get(record.value(), set()) | {count}
        assert record.partition() < count
        assert record.key().startswith(b"k") and headers["phase"] in (b"1", b"2")
        assert set(headers) == {HEADER_PARTITION_COUNT, "phase"}
    assert stamps[b"before"] == {2}
    assert 5 in stamps[b"after"]


def test_pause_on_failure_and_resume(restartable: StackBackend, kafka_config: dict[str, Any],
                                     topic_factory: Callable[..., str]) -> None:
    """PUB-2: a key whose publish finally fails is paused (queued and later publishes of it fail at
    once with a typed error) until resume_publish; other keys are unaffected."""
    topic = topic_factory(partitions=2)
    config = {**kafka_config, "delivery.timeout.ms": 3000, "linger.ms": 50}
    with OrderedProducer(config) as producer:
        producer.publish(topic, b"warm-up", ordering_key="other").result(timeout=30)
        restartable.stop_broker()
        try:
            failing = [producer.publish(topic, f"doomed-{n}".encode(), ordering_key="doomed") for n in range(3)]
            wait(failing, timeout=30)
            errors = [f.exception() for f in failing]
            assert all(isinstance(e, PublishError) for e in errors)
            assert all(isinstance(e, OrderingKeyPausedError) for e in errors[1:])
            assert producer.is_paused("doomed")
            with pytest.raises(OrderingKeyPausedError):
                producer.publish(topic, b"refused", ordering_key="doomed")
        finally:
            restartable.start_broker()
        # The broker answers before the topic's partitions have their leader back; the producer's
        # 3 s delivery timeout would be spent waiting for it on a loaded machine.
        admin = AdminClient(kafka_config)
        wait_until(lambda: all(p.leader >= 0 for p in admin.list_topics(topic, timeout=5).topics[topic]
                               .partitions.values()), 60, "the partition leaders after the broker restart")
        assert producer.publish(topic, b"fine", ordering_key="other").result(timeout=60).offset >= 0
        with pytest.raises(OrderingKeyPausedError):
            producer.publish(topic, b"still-refused", ordering_key="doomed")
        producer.resume_publish("doomed")
        resumed = producer.publish(topic, b"resumed", ordering_key="doomed").result(timeout=60)
    records = read_topic(kafka_config, topic, 3)
    stored = sorted(r.value() for r in records)
    assert [r.value() for r in records if r.key() == b"doomed"] == [b"resumed"]
    assert len(stored) == 3
    assert resumed.partition == next(r.partition() for r in records if r.key() == b"doomed")


def test_bad_input_is_refused_before_sending(kafka_config: dict[str, Any],
                                             topic_factory: Callable[..., str]) -> None:
    """PUB-4: invalid keys, oversized messages, bad attributes, unknown settings and a missing
    bootstrap each give a clear typed error, and nothing reaches the topic."""
    topic = topic_factory(partitions=1)
    with OrderedProducer(kafka_config) as producer:
        cases: list[tuple[Callable[[], object], type[Exception], str]] = [
            (lambda: producer.publish(topic, b"x", ordering_key="k" * 1025), InvalidOrderingKeyError, "1025 bytes"),
            (lambda: producer.publish(topic, b"x", ordering_key="é" * 513), InvalidOrderingKeyError, "1026 bytes"),
            (lambda: producer.publish(topic, b"x", ordering_key=b"\xc3\x28"), InvalidOrderingKeyError, "UTF-8"),
            (lambda: producer.publish(topic, b"x", ordering_key="\udc80"), InvalidOrderingKeyError, "UTF-8"),
            (lambda: producer.publish(topic, b"x", ordering_key=42), InvalidOrderingKeyError,  # type: ignore[arg-type]
             "str or bytes"),
            (lambda: producer.produce(topic, b"x", key=b"\xff"), InvalidOrderingKeyError, "UTF-8"),
            (lambda: producer.publish(topic, b"x" * 1_000_001), MessageTooLargeError, "limit is"),
            (lambda: producer.publish(topic, "text"), InvalidMessageError, "bytes"),  # type: ignore[arg-type]
            (lambda: producer.publish(topic, b"x", attributes={"a": 1}), InvalidMessageError,  # type: ignore[dict-item]
             "str to str"),
            (lambda: producer.publish("no-such-topic-here", b"x"), TopicError, "no-such-topic-here"),
        ]
        for call, error, text in cases:
            with pytest.raises(error, match=text):
                call()
        ok = producer.publish(topic, b"ok", ordering_key="k" * 1024).result(timeout=30)
    assert end_offsets(kafka_config, topic) == {0: ok.offset + 1}
    assert ok.offset == 0

    for config, settings, text in [
        ({}, None, "bootstrap.servers"),
        (kafka_config, {"max_mesage_bytes": 10}, "max_mesage_bytes"),
        ({**kafka_config, "no.such.kafka.setting": 1}, None, "no.such.kafka.setting"),
        ({**kafka_config, "acks": 1}, None, "acks=all"),
        ({**kafka_config, "enable.idempotence": False}, None, "idempotence"),
        (kafka_config, {"max_message_bytes": 0}, "max_message_bytes"),
    ]:
        with pytest.raises(ConfigError, match=text):
            OrderedProducer(config, settings=settings)


def test_drop_in_produce_flush_and_close_lose_nothing(kafka_config: dict[str, Any],
                                                      topic_factory: Callable[..., str]) -> None:
    """PUB-1, PUB-3: the confluent-kafka shaped produce() with on_delivery; close() flushes all."""
    topic = topic_factory(partitions=3)
    reports: list[tuple[KafkaError | None, KafkaMessage]] = []
    producer = OrderedProducer(kafka_config)
    for n in range(20_000):
        producer.produce(topic, value=f"v{n}".encode(), key=f"key-{n % 100}",
                         headers={"n": str(n)}, on_delivery=lambda err, msg: reports.append((err, msg)))
    assert producer.close() == 0
    assert len(reports) == 20_000
    assert all(err is None for err, _ in reports)
    assert sum(end_offsets(kafka_config, topic).values()) == 20_000
    records = read_topic(kafka_config, topic, 20_000)
    numbers = {int(headers_of(record)["n"]) for record in records}
    assert all(record.value() == f"v{headers_of(record)['n'].decode()}".encode() for record in records)
    assert numbers == set(range(20_000))
    with pytest.raises(PublishError, match="closed"):
        producer.publish(topic, b"late")


def test_futures_resolve_while_publishing_slowly(kafka_config: dict[str, Any],
                                                 topic_factory: Callable[..., str]) -> None:
    """PUB-3: a steady trickle of publishes (never 256 in a row that the publishing thread would
    poll after) still sees its futures resolve promptly, served by the background poll thread."""
    topic = topic_factory(partitions=2)
    with OrderedProducer(kafka_config) as producer:
        producer.publish(topic, b"warm-up", ordering_key="k").result(timeout=30)
        futures: list[Future[PublishResult]] = []
        late = 0
        for n in range(150):
            futures.append(producer.publish(topic, str(n).encode(), ordering_key=f"k{n % 5}"))
            time.sleep(0.01)
            if n >= 50 and not futures[n - 50].done():  # published ~0.5 s ago
                late += 1
        assert late <= 5
        assert all(f.result(timeout=30).offset >= 0 for f in futures)
