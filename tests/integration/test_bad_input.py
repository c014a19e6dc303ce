"""Bad input, record by record: each one reaches user code or a dead-letter topic (DLQ-4, PUB-7).

The records are written by a plain confluent-kafka producer, as any other producer could: malformed
``ol-`` headers, huge headers, empty and absent keys, empty and null values, a key and header values
that are not UTF-8, and a payload over the flow-control byte limit. None may be settled unseen,
crash the subscriber or block a key.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
from confluent_kafka import Producer

from ordering_layer import Admin, DeadLetterPolicy, FlowControl, Message, OrderedConsumer, Subscriber
from tests.checker import wait_until

pytestmark = pytest.mark.integration

Headers = list[tuple[str, str | bytes | None]]


class Case(NamedTuple):
    name: str
    key: bytes | None
    value: bytes | None
    headers: Headers
    data: bytes  # what Message.data must be
    attributes: dict[str, str]  # what Message.attributes must be
    ordering_key: str  # what Message.ordering_key must show


HUGE: Headers = [(f"h{i}", b"x" * 2048) for i in range(50)]
CASES = [
    Case("malformed count", b"k-a", b"v1", [("ol-partition-count", b"many")], b"v1", {}, "k-a"),
    Case("malformed id", b"k-a", b"v2", [("ol-message-id", b"\xff\xfe"), ("a", b"1")], b"v2", {"a": "1"}, "k-a"),
    Case("huge headers", b"k-b", b"v3", HUGE, b"v3", {name: "x" * 2048 for name, _ in HUGE}, "k-b"),
    Case("empty key", b"", b"unkeyed", [], b"unkeyed", {}, ""),
    Case("absent key", None, b"no key", [], b"no key", {}, ""),
    Case("empty value", b"k-c", b"", [], b"", {}, "k-c"),
    Case("null value", b"k-c", None, [], b"", {}, "k-c"),
    Case("non-UTF-8 key", b"\xff\xfekey", b"v4", [], b"v4", {}, "\\xff\\xfekey"),
    Case("non-UTF-8 header", b"k-d", b"v5", [("bin", b"\xff"), ("ok", b"yes"), ("none", None)], b"v5",
         {"ok": "yes"}, "k-d"),
    Case("over max_bytes", b"k-e", b"z" * 150_000, [], b"z" * 150_000, {}, "k-e"),
]


def _write(kafka_config: dict[str, Any], topic: str) -> None:
    producer = Producer({**kafka_config, "message.max.bytes": 2_000_000})
    for case in CASES:
        producer.produce(topic, case.value, case.key, headers=case.headers)
        producer.flush(30)  # one at a time: offset i is CASES[i]
    assert producer.flush(30) == 0


def _check(message: Message, case: Case) -> None:
    assert (message.data, message.attributes, message.ordering_key) == (case.data, case.attributes,
                                                                        case.ordering_key), case.name
    assert message.key() == (case.key or None) or (case.key == b"" and message.key() in (b"", None)), case.name
    assert message.value() == case.value, case.name
    assert list(message.headers() or []) == case.headers, case.name
    assert message.message_id == str(message.sequence_number), case.name


def test_every_bad_record_reaches_user_code(kafka_config: dict[str, Any], endpoints: Any,
                                            subscription: Callable[..., tuple[str, str]],
                                            caplog: pytest.LogCaptureFixture) -> None:
    """DLQ-4, PUB-7: without a dead-letter policy every record is delivered as it was written, the
    malformed ol- metadata is counted and warned about, and the subscription ends with no backlog."""
    topic, name = subscription(partitions=1)
    _write(kafka_config, topic)
    seen: dict[int, Message] = {}
    lock = threading.Lock()

    def callback(message: Message) -> None:
        with lock:
            seen[message.offset()] = message
        message.ack()

    caplog.set_level(logging.WARNING, logger="ordering_layer")
    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with subscriber.subscribe(name, callback, flow_control=FlowControl(max_bytes=100_000)) as streaming:
        wait_until(lambda: len(seen) == len(CASES), 60, "every record delivered")
        assert streaming.engine.malformed_records == 2
    for offset, case in enumerate(CASES):
        _check(seen[offset], case)
    assert "malformed layer metadata" in caplog.text
    admin = Admin(kafka_config, redis_url=endpoints.redis_url)
    wait_until(lambda: admin.describe_subscription(name).backlog == 0, 30, "all committed")


def test_bad_records_through_the_drop_in_consumer(kafka_config: dict[str, Any], endpoints: Any,
                                                  subscription: Callable[..., tuple[str, str]]) -> None:
    """DLQ-4, DRP-2: the same records through OrderedConsumer's poll loop, as they were written."""
    topic, name = subscription(partitions=1)
    _write(kafka_config, topic)
    consumer = OrderedConsumer({**kafka_config, "group.id": name}, redis_url=endpoints.redis_url)
    consumer.subscribe([topic])
    got: dict[int, Message] = {}
    deadline = time.monotonic() + 60
    try:
        while len(got) < len(CASES) and time.monotonic() < deadline:
            for message in consumer.consume(20, 0.2):
                got[message.offset()] = message
    finally:
        consumer.close()
    for offset, case in enumerate(CASES):
        _check(got[offset], case)


def test_bad_records_that_fail_are_dead_lettered_byte_for_byte(
        kafka_config: dict[str, Any], endpoints: Any, admin: Admin,
        subscription: Callable[..., tuple[str, str]], unique_name: Callable[[str], str]) -> None:
    """DLQ-2, DLQ-4: records user code keeps failing reach the dead-letter topic with key, value and
    headers as written; nothing is settled unseen."""
    dlq = unique_name("dlq")
    topic, name = subscription(partitions=1, dead_letter_policy=DeadLetterPolicy(dlq, max_delivery_attempts=5))
    _write(kafka_config, topic)
    attempts: dict[int, int] = {}
    lock = threading.Lock()

    def always_fails(message: Message) -> None:
        with lock:
            attempts[message.offset()] = message.delivery_attempt
        message.nack()

    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with subscriber.subscribe(name, always_fails, flow_control=FlowControl(max_bytes=100_000)):
        wait_until(lambda: len(admin.list_dead_letters(name)) == len(CASES), 120, "every record dead-lettered")
    assert attempts == dict.fromkeys(range(len(CASES)), 5)
    letters = {d.source_offset: d for d in admin.list_dead_letters(name)}
    for offset, case in enumerate(CASES):
        letter = letters[offset]
        assert (letter.key or None, letter.value, letter.headers) == (case.key or None, case.value, case.headers)
        assert letter.reason == "MAX_DELIVERY_ATTEMPTS" and letter.delivery_attempts == 5
