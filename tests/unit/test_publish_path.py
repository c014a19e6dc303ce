"""OrderedProducer's publish path without a broker: what reaches produce(), and the futures."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from confluent_kafka import KafkaError

from ordering_layer import OrderedProducer, PublishResult
from ordering_layer.errors import (
    InvalidMessageError,
    InvalidOrderingKeyError,
    MessageTooLargeError,
    OrderingKeyPausedError,
    PublishError,
    UnsupportedOperationError,
)
from ordering_layer.kafka.partitioner import partition_for
from ordering_layer.publisher import producer as producer_module
from ordering_layer.record import HEADER_MESSAGE_ID, HEADER_PARTITION_COUNT


class FakeMessage:
    """What a delivery report carries, as far as the producer reads it."""

    def __init__(self, topic: str, key: bytes | None, partition: int = 0, offset: int = 0,
                 stamp: int = 1_700_000_000_123) -> None:
        self._topic, self._key, self._partition, self._offset, self._stamp = topic, key, partition, offset, stamp

    def topic(self) -> str:
        return self._topic

    def key(self) -> bytes | None:
        return self._key

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def timestamp(self) -> tuple[int, int]:
        return 2, self._stamp

    def latency(self) -> float:
        return 0.004


@pytest.fixture
def sent() -> Iterator[tuple[OrderedProducer, list[tuple[Any, ...]]]]:
    """A producer whose produce() records its arguments, with topic "t" cached at 6 partitions."""
    producer = OrderedProducer({"bootstrap.servers": "127.0.0.1:9", "log_level": 0})
    calls: list[tuple[Any, ...]] = []
    producer._produce = lambda *args, **kwargs: calls.append(args)
    header = (HEADER_PARTITION_COUNT, b"6")
    producer._topics["t"] = producer_module._Topic(6, float("inf"), header, 100)
    yield producer, calls
    producer.close(0)


def deliver(call: tuple[Any, ...], err: KafkaError | None = None, offset: int = 0) -> None:
    topic, _, key, partition, on_delivery, _, _, _ = call
    on_delivery(err, FakeMessage(topic, key, partition, offset))


def test_record_shape(sent: tuple[OrderedProducer, list[tuple[Any, ...]]]) -> None:
    """PUB-6: key = ordering key, value = payload byte for byte, headers = count + attributes (+ given id)."""
    producer, calls = sent
    producer.publish("t", b"payload", ordering_key="customer-1")
    producer.publish("t", bytearray(b"more"), ordering_key=b"customer-1",  # type: ignore[arg-type]
                     attributes={"v": "1"})
    producer.publish("t", b"free")
    producer.publish("t", b"x" * 5000, ordering_key="", message_id="order-17")
    (topic, value, key, partition, _, _, timestamp, headers) = calls[0]
    assert (topic, value, key, partition, timestamp) == ("t", b"payload", b"customer-1",
                                                         partition_for(b"customer-1", 6), 0)
    assert headers == [(HEADER_PARTITION_COUNT, b"6")]
    assert calls[1][3] == partition  # same key, str or bytes: same partition
    assert calls[1][1] == b"more" and calls[1][7] == [(HEADER_PARTITION_COUNT, b"6"), ("v", b"1")]
    assert calls[2][2] is None and calls[2][3] == -1  # unordered: librdkafka picks
    assert calls[3][1] == b"x" * 5000
    assert calls[3][7] == [(HEADER_PARTITION_COUNT, b"6"), (HEADER_MESSAGE_ID, b"order-17")]


def test_reserved_attribute_names_are_refused(sent: tuple[OrderedProducer, list[tuple[Any, ...]]]) -> None:
    """PUB-4, PUB-6: attribute and header names starting with ol- are refused before sending."""
    producer, calls = sent
    with pytest.raises(InvalidMessageError, match="reserved prefix"):
        producer.publish("t", b"x", attributes={"ol-partition-count": "1"})
    with pytest.raises(InvalidMessageError, match="reserved prefix"):
        producer.produce("t", b"x", headers=[("ol-message-id", b"forged")])
    with pytest.raises(InvalidMessageError):
        producer.publish("t", b"x", message_id="")
    with pytest.raises(InvalidMessageError):
        producer.publish("t", b"x", attributes={"n": 1})  # type: ignore[dict-item]
    assert calls == []


def test_future_resolves_lazily_to_publish_result(sent: tuple[OrderedProducer, list[tuple[Any, ...]]]) -> None:
    producer, calls = sent
    future = producer.publish("t", b"a", ordering_key="k")
    assert not future.done()
    deliver(calls[0], offset=41)
    assert future.done() and future.exception() is None
    result = future.result()
    assert isinstance(result, PublishResult)
    assert result.message_id == str(result.sequence_number), "no id header: the id is the sequence number"
    assert (result.partition, result.offset) == (calls[0][3], 41)
    assert result.sequence_number == (result.partition << 48) | 41
    assert result.enqueued_time == datetime.fromtimestamp(1_700_000_000.123, tz=UTC)
    assert future.result() is result


def test_publish_latency_sampled_at_offsets_multiple_of_64(
        sent: tuple[OrderedProducer, list[tuple[Any, ...]]]) -> None:
    """PUB-3: the delivery report samples publish latency for 1 record in 64 (by offset), for metrics."""
    producer, calls = sent
    for offset in range(130):
        producer.publish("t", b"x", ordering_key="k")
        deliver(calls[-1], offset=offset)
    assert producer.metrics_snapshot() == {"paused_keys": 0, "publish_latency_seconds": [("t", 0.004)] * 3}
    assert producer.metrics_snapshot()["publish_latency_seconds"] == []  # drained


def test_failure_pauses_key_until_resume(sent: tuple[OrderedProducer, list[tuple[Any, ...]]]) -> None:
    producer, calls = sent
    first = producer.publish("t", b"1", ordering_key="k")
    second = producer.publish("t", b"2", ordering_key="k")
    other = producer.publish("t", b"3", ordering_key="other")
    unordered = producer.publish("t", b"4")
    timeout = KafkaError(KafkaError._MSG_TIMED_OUT)
    deliver(calls[0], timeout)
    deliver(calls[1], timeout)
    deliver(calls[2])
    deliver(calls[3], timeout)
    assert type(first.exception()) is PublishError
    assert isinstance(second.exception(), OrderingKeyPausedError)
    assert other.exception() is None
    assert type(unordered.exception()) is PublishError and not producer.is_paused("")
    assert producer.is_paused("k") and producer.is_paused(b"k") and not producer.is_paused("other")
    with pytest.raises(OrderingKeyPausedError):
        producer.publish("t", b"5", ordering_key="k")
    with pytest.raises(OrderingKeyPausedError):
        producer.publish("t", b"5", ordering_key=b"k")
    assert len(calls) == 4
    producer.publish("t", b"6", ordering_key="other")
    producer.resume_publish("k")
    producer.publish("t", b"7", ordering_key="k")
    assert len(calls) == 6


def test_drop_in_callback_after_the_future(sent: tuple[OrderedProducer, list[tuple[Any, ...]]]) -> None:
    """DRP-1: produce() takes confluent-kafka's arguments, positional or keyword; headers pass through."""
    producer, calls = sent
    reports: list[tuple[KafkaError | None, Any]] = []
    producer.produce("t", "text", key="k", headers=[("h", b"\xff"), ("n", None)],
                     on_delivery=lambda e, m: reports.append((e, m)))
    producer.produce("t", b"v", "k", -1, lambda e, m: reports.append((e, m)))  # positional callback
    producer.produce("t", None, b"k", 2, callback=lambda e, m: reports.append((e, m)), headers={"a": "b"})
    deliver(calls[0], offset=3)
    deliver(calls[1], offset=4)
    deliver(calls[2], offset=5)
    assert [r[1].offset() for r in reports] == [3, 4, 5] and all(r[0] is None for r in reports)
    assert calls[0][1] == b"text" and calls[0][7][1:] == [("h", b"\xff"), ("n", None)]
    assert calls[2][1] == b"" and calls[2][3] == 2 and calls[2][7][1:] == [("a", "b")]


def test_drop_in_surface(sent: tuple[OrderedProducer, list[tuple[Any, ...]]]) -> None:
    """DRP-1: (**conf) construction, len(), bool, produce_batch, and transactions refused by type."""
    producer, calls = sent
    # len() is librdkafka's out-queue length: with no broker its connection errors count too, so only
    # compare it with the client's own; an OrderedProducer is true even when that length is 0.
    assert len(producer) == len(producer._producer) and bool(producer)
    assert producer.produce_batch("t", [{"value": b"a", "key": "k"}, {"value": b"b"}]) == 2
    assert [c[1] for c in calls] == [b"a", b"b"]
    with pytest.raises(UnsupportedOperationError):
        producer.init_transactions()
    with pytest.raises(UnsupportedOperationError):
        producer.begin_transaction()
    conf: dict[str, Any] = {"bootstrap.servers": "127.0.0.1:9", "log_level": 0}
    more: dict[str, Any] = {"log_level": 0, "linger.ms": 1}
    other = OrderedProducer(**conf)
    merged = OrderedProducer({"bootstrap.servers": "127.0.0.1:9"}, **more)
    assert other.poll(0) == 0 and merged.flush(0) == 0
    other.close(0)
    merged.close(0)


def test_keys_are_checked_every_time(sent: tuple[OrderedProducer, list[tuple[Any, ...]]]) -> None:
    producer, calls = sent
    for _ in range(2):  # the second time after a good key was cached
        producer.publish("t", b"x", ordering_key="k" * 1024)
        with pytest.raises(InvalidOrderingKeyError):
            producer.publish("t", b"x", ordering_key="k" * 1025)
        with pytest.raises(InvalidOrderingKeyError):
            producer.publish("t", b"x", ordering_key=b"\xc3\x28")
        with pytest.raises(InvalidOrderingKeyError):
            producer.publish("t", b"x", ordering_key=["k"])  # type: ignore[arg-type]
        with pytest.raises(InvalidOrderingKeyError):
            producer.publish("t", b"x", ordering_key=42)  # type: ignore[arg-type]
    assert len(calls) == 2


def test_key_cache_is_bounded(sent: tuple[OrderedProducer, list[tuple[Any, ...]]],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    producer, calls = sent
    monkeypatch.setattr(producer_module, "_KEY_CACHE_SIZE", 10)
    for n in range(25):
        producer.publish("t", b"x", ordering_key=f"key-{n}")
    assert len(producer._keys) <= 10
    assert [call[3] for call in calls] == [partition_for(f"key-{n}".encode(), 6) for n in range(25)]


@pytest.mark.parametrize("size", [0, 1, 2047, 2048, 70_000])
def test_payload_is_sent_byte_for_byte(sent: tuple[OrderedProducer, list[tuple[Any, ...]]], size: int) -> None:
    """PUB-6: the record value is the payload itself, from bytes or a memoryview."""
    producer, calls = sent
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    producer.publish("t", data, ordering_key="k")
    producer.publish("t", memoryview(data))  # type: ignore[arg-type]
    assert calls[0][1] == calls[1][1] == data


def test_size_limit_counts_value_key_and_headers() -> None:
    """PUB-4: value, key and headers together must fit the limit."""
    producer = OrderedProducer({"bootstrap.servers": "127.0.0.1:9", "log_level": 0},
                               settings={"max_message_bytes": 3000})
    try:
        calls: list[tuple[Any, ...]] = []
        producer._produce = lambda *args, **kwargs: calls.append(args)
        producer._topics["t"] = producer_module._Topic(6, float("inf"), (HEADER_PARTITION_COUNT, b"6"), 100)
        key = "k" * 500
        fits = 3000 - 100 - len(key)
        producer.publish("t", b"x" * fits, ordering_key=key)
        with pytest.raises(MessageTooLargeError, match="3001 bytes"):
            producer.publish("t", b"x" * (fits + 1), ordering_key=key)
        producer.publish("t", b"x" * (fits + 1), ordering_key=key[1:])
        attribute = {"a": "y" * 600}
        with pytest.raises(MessageTooLargeError):
            producer.publish("t", b"x" * (fits - 500), ordering_key=key, attributes=attribute)
        assert len(calls) == 2
    finally:
        producer.close(0)
