"""OrderedProducer's publish path without a broker: what reaches produce(), and the futures."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from confluent_kafka import KafkaError

from ordering_layer import OrderedProducer, PublishResult
from ordering_layer.envelope import HEADER_MESSAGE_ID, HEADER_PARTITION_COUNT, decode_record, encode_envelope
from ordering_layer.errors import (
    InvalidOrderingKeyError,
    MessageTooLargeError,
    OrderingKeyPausedError,
    PublishError,
)
from ordering_layer.publisher import producer as producer_module
from ordering_layer.publisher.partitioner import partition_for


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
    producer, calls = sent
    producer.publish("t", b"payload", ordering_key="customer-1")
    producer.publish("t", bytearray(b"more"), ordering_key=b"customer-1",  # type: ignore[arg-type]
                     attributes={"v": "1"})
    producer.publish("t", b"free")
    producer.publish("t", b"x" * 5000, ordering_key="")
    (topic, value, key, partition, _, _, timestamp, headers) = calls[0]
    assert (topic, key, partition, timestamp) == ("t", b"customer-1", partition_for(b"customer-1", 6), 0)
    decoded = decode_record(key, value, headers)
    assert (decoded.data, decoded.attributes, decoded.partition_count) == (b"payload", {}, 6)
    assert value == encode_envelope(b"payload", {})
    assert calls[1][3] == partition  # same key, str or bytes: same partition
    assert decode_record(calls[1][2], calls[1][1], calls[1][7]).attributes == {"v": "1"}
    assert calls[2][2] is None and calls[2][3] == -1  # unordered: librdkafka picks
    assert calls[3][2] is None and decode_record(None, calls[3][1], calls[3][7]).data == b"x" * 5000
    ids = [dict(call[7])[HEADER_MESSAGE_ID] for call in calls]
    assert len(set(ids)) == len(ids)


def test_future_resolves_lazily_to_publish_result(sent: tuple[OrderedProducer, list[tuple[Any, ...]]]) -> None:
    producer, calls = sent
    future = producer.publish("t", b"a", ordering_key="k")
    assert not future.done()
    deliver(calls[0], offset=41)
    assert future.done() and future.exception() is None
    result = future.result()
    assert isinstance(result, PublishResult)
    assert result.message_id.encode() == dict(calls[0][7])[HEADER_MESSAGE_ID]
    assert (result.partition, result.offset) == (calls[0][3], 41)
    assert result.sequence_number == (result.partition << 48) | 41
    assert result.enqueued_time == datetime.fromtimestamp(1_700_000_000.123, tz=UTC)
    assert future.result() is result


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
    producer, calls = sent
    reports: list[tuple[KafkaError | None, Any]] = []
    producer.produce("t", "text", key="k", headers=[("h", b"v")], on_delivery=lambda e, m: reports.append((e, m)))
    deliver(calls[0], offset=3)
    assert len(reports) == 1 and reports[0][0] is None and reports[0][1].offset() == 3
    assert decode_record(calls[0][2], calls[0][1], calls[0][7]).attributes == {"h": "v"}


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


@pytest.mark.parametrize("size", [0, 1, 63, 64, 100, 2047, 2048, 70_000])
def test_envelope_fast_path_equals_encoder(sent: tuple[OrderedProducer, list[tuple[Any, ...]]], size: int) -> None:
    producer, calls = sent
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    producer.publish("t", data, ordering_key="k")
    producer.publish("t", memoryview(data))  # type: ignore[arg-type]
    assert calls[0][1] == calls[1][1] == encode_envelope(data, {})


def test_size_limit_counts_value_key_and_headers() -> None:
    producer = OrderedProducer({"bootstrap.servers": "127.0.0.1:9", "log_level": 0},
                               settings={"max_message_bytes": 3000})
    try:
        calls: list[tuple[Any, ...]] = []
        producer._produce = lambda *args, **kwargs: calls.append(args)
        producer._topics["t"] = producer_module._Topic(6, float("inf"), (HEADER_PARTITION_COUNT, b"6"), 100)
        message_id = len(producer._id_prefix) + 1  # the first ids have one hex digit
        key = "k" * 500
        fits = 3000 - 100 - message_id - len(key) - 3  # envelope: 2-byte length and the empty map
        producer.publish("t", b"x" * fits, ordering_key=key)
        with pytest.raises(MessageTooLargeError, match="3001 bytes"):
            producer.publish("t", b"x" * (fits + 1), ordering_key=key)
        producer.publish("t", b"x" * (fits + 1), ordering_key=key[1:])
        assert len(calls) == 2
    finally:
        producer.close(0)
