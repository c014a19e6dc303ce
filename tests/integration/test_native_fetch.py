"""The native fetch (``_core.NativeFetch``) makes the same records as ``consume()`` and ``to_record``.

Records of every shape (null and empty keys and values, binary bytes, user headers with null values,
the layer's metadata, malformed metadata) are read twice from one topic: by a plain confluent-kafka
consumer through ``to_record``, and by the subscriber's ``Fetcher`` with its native fetch; every field
of every record must match, and malformed metadata must be counted the same (DLQ-4). On a release of
confluent-kafka the native fetch does not know, the fetcher and a subscriber consume, and lose nothing.
"""

from __future__ import annotations

import gc
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer

from ordering_layer import FlowControl, Message, OrderedProducer, Subscriber
from ordering_layer.record import HEADER_MESSAGE_ID, HEADER_PARTITION_COUNT
from ordering_layer.subscriber import native_fetch
from ordering_layer.subscriber.fetched import to_record
from ordering_layer.subscriber.fetcher import Fetcher, RebalanceHooks
from ordering_layer.subscriber.flow import FlowGate
from ordering_layer.subscriber.records import Record
from ordering_layer.subscriber.requests import Fetched
from tests.checker import wait_until
from tests.fetch_helpers import OwnAll, report_release
from tests.integration.conftest import publish_keys, recording_callback

FIELDS = ("partition", "offset", "key", "value", "headers", "metadata", "size", "timestamp_ms")


def produce_shapes(kafka_config: dict[str, Any], topic: str) -> int:
    """Records of every shape, on both partitions; returns how many."""
    shapes: list[tuple[bytes | None, bytes | None, list[tuple[str, str | bytes | None]] | None]] = [
        (None, None, None),
        (b"", b"", None),
        (b"k", b"v", [(HEADER_MESSAGE_ID, b"id-1"), ("attr", b"x"), ("empty", None)]),
        (b"\xff\x00key", bytes(range(256)), [("attr", b"\xff\xfe")]),
        (b"m", b"bad count", [(HEADER_PARTITION_COUNT, b"abc")]),
        (b"m", b"bad id", [(HEADER_MESSAGE_ID, b"")]),
        (b"dup", b"two", [("a", b"1"), ("a", b"2")]),
    ]
    producer = Producer(kafka_config)
    count = 0
    for partition in (0, 1):
        for key, value, headers in shapes:
            producer.produce(topic, value, key=key, partition=partition, headers=headers)
            count += 1
    producer.flush(30)
    with OrderedProducer(kafka_config) as ordered:
        for n in range(20):
            ordered.produce(topic, b"plain-%d" % n, key=b"key-%d" % (n % 4))
            count += 1
    return count


def by_consume(kafka_config: dict[str, Any], topic: str, count: int) -> dict[tuple[int, int], Record]:
    consumer = Consumer({**kafka_config, "group.id": f"plain-{uuid.uuid4().hex}", "auto.offset.reset": "earliest",
                         "enable.auto.commit": False})
    consumer.subscribe([topic])
    records: dict[tuple[int, int], Record] = {}
    deadline = time.monotonic() + 60
    while len(records) < count and time.monotonic() < deadline:
        for msg in consumer.consume(100, 0.5):
            if msg.error() is None:
                record = to_record(msg)
                records[record.partition, record.offset] = record
    consumer.close()
    return records


def by_fetcher(kafka_config: dict[str, Any], topic: str, count: int,
               native: bool) -> tuple[dict[tuple[int, int], Record], Fetcher]:
    posted: list[Any] = []
    config = {**kafka_config, "group.id": f"native-{uuid.uuid4().hex}", "auto.offset.reset": "earliest",
              "enable.auto.commit": False, "partition.assignment.strategy": "cooperative-sticky"}
    gate = FlowGate(FlowControl(max_messages=10_000))
    fetcher = Fetcher(config, "native-test", topic, gate, OwnAll(), posted.append, RebalanceHooks(), native=native)
    fetcher.consumer.subscribe([topic], on_assign=fetcher._on_assign, on_revoke=fetcher._on_revoke,
                               on_lost=fetcher._on_lost)
    records: dict[tuple[int, int], Record] = {}
    deadline = time.monotonic() + 60
    try:
        while len(records) < count and time.monotonic() < deadline:
            fetcher.step()
            for event in posted:
                if isinstance(event, Fetched):
                    gate.taken(len(event.records))
                    records.update(((r.partition, r.offset), r) for r in event.records)
            posted.clear()
    finally:
        fetcher.close()
    return records, fetcher


def fields(record: Record) -> tuple[Any, ...]:
    values = [getattr(record, name) for name in FIELDS]
    values[FIELDS.index("headers")] = None if record.headers is None else list(record.headers)
    return tuple(values)


def test_native_fetch_makes_the_records_consume_makes(kafka_config: dict[str, Any],
                                                       topic_factory: Callable[..., str]) -> None:
    topic = topic_factory(partitions=2)
    count = produce_shapes(kafka_config, topic)
    expected = by_consume(kafka_config, topic, count)
    assert len(expected) == count
    got, fetcher = by_fetcher(kafka_config, topic, count, native=True)
    assert fetcher.native is not None, "the native fetch was not used"
    assert sorted(got) == sorted(expected)
    for position, record in expected.items():
        assert fields(got[position]) == fields(record), position
    malformed = sum(1 for record in expected.values() if record.metadata.malformed is not None)
    assert malformed == 4
    assert fetcher.malformed_records == malformed  # DLQ-4: counted once per record, as consume() counts


def test_native_records_are_out_of_the_collectors_sight(kafka_config: dict[str, Any],
                                                         topic_factory: Callable[..., str]) -> None:
    """The records the native fetch makes are not tracked by the cyclic garbage collector (none can
    be part of a cycle); those of ``consume()`` are, as any new compiled object."""
    topic = topic_factory(partitions=2)
    count = produce_shapes(kafka_config, topic)
    native, fetcher = by_fetcher(kafka_config, topic, count, native=True)
    assert fetcher.native is not None, "the native fetch was not used"
    assert len(native) == count
    assert not any(gc.is_tracked(record) for record in native.values())
    consumed, _ = by_fetcher(kafka_config, topic, count, native=False)
    assert all(gc.is_tracked(record) for record in consumed.values())


def test_without_the_native_fetch_the_fetcher_consumes(kafka_config: dict[str, Any],
                                                        topic_factory: Callable[..., str]) -> None:
    topic = topic_factory(partitions=2)
    count = produce_shapes(kafka_config, topic)
    got, fetcher = by_fetcher(kafka_config, topic, count, native=False)
    assert fetcher.native is None
    assert len(got) == count


def test_on_another_release_the_fetcher_consumes_the_same_records(kafka_config: dict[str, Any],
                                                                  topic_factory: Callable[..., str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """On a confluent-kafka release outside the tested ones the native fetch is not opened; the
    fetcher's ``consume()`` makes every record, field for field."""
    report_release(monkeypatch, "2.17.0")
    topic = topic_factory(partitions=2)
    count = produce_shapes(kafka_config, topic)
    expected = by_consume(kafka_config, topic, count)
    got, fetcher = by_fetcher(kafka_config, topic, count, native=True)
    assert fetcher.native is None
    assert sorted(got) == sorted(expected)
    for position, record in expected.items():
        assert fields(got[position]) == fields(record), position


def test_a_subscriber_on_another_release_delivers_everything(kafka_config: dict[str, Any], endpoints: Any,
                                                             subscription: Callable[..., tuple[str, str]],
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """SUB-1, SUB-3, SUB-4 with the fetch through ``consume()`` (a librdkafka release outside the
    tested ones): every message is delivered in key order and acked, a nacked one cascades."""
    report_release(monkeypatch, librdkafka_version="2.17.0")
    topic, name = subscription(partitions=3)
    checker = publish_keys(kafka_config, topic, keys=20, per_key=10)
    nacked: set[str] = set()

    def nack_every_seventh_once(message: Message) -> str:
        if int(message.data.split(b":")[1]) % 7 == 3 and message.message_id not in nacked:
            nacked.add(message.message_id)
            return "nack"
        return "ack"

    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with caplog.at_level(logging.INFO, logger=native_fetch.__name__), \
            subscriber.subscribe(name, recording_callback(checker, "s1", nack_every_seventh_once), max_workers=4):
        wait_until(lambda: checker.acked_count() == checker.total(), 120, "all messages acked")
    assert checker.verify() == []
    assert nacked
    assert "fetching through consume(): librdkafka 2.17.0 is not a release" in caplog.text
