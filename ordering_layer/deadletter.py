"""Reading and redriving a subscription's dead-letter topic (DLQ-5).

Dead letters are read with a plain consumer; a redrive republishes each source record byte for byte
(key, value, headers) to the source topic or another one, partition by partition in dead-letter
order, so each key keeps its original order. The message id is kept: a record that had no
``ol-message-id`` header (its id was its sequence number in the source) gets one with that id, so
duplicates stay detectable.
Redrive progress is committed in the consumer group ``<subscription>.redrive``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Producer, TopicPartition

from ordering_layer.errors import ConfigError, PublishError, RecordFormatError
from ordering_layer.kafka.offsets import retrying, watermarks
from ordering_layer.kafka.partitioner import partition_for
from ordering_layer.kafka_config import connection_settings
from ordering_layer.record import HEADER_MESSAGE_ID, HEADER_PARTITION_COUNT, decode, display_key

_LOGGER = logging.getLogger(__name__)
_TIMEOUT = 30.0


@dataclass(frozen=True)
class DeadLetter:
    """One record of a dead-letter topic, decoded."""

    dead_letter_partition: int
    dead_letter_offset: int
    source_topic: str
    source_partition: int
    source_offset: int
    sequence_number: int
    subscription: str
    reason: str
    delivery_attempts: int
    last_error: str | None
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]

    @property
    def ordering_key(self) -> str | None:
        """The source record's ordering key as text (see ``record.display_key``); None when unordered."""
        return display_key(self.key) or None

    @property
    def message_id(self) -> str:
        """The source message's id: its ``ol-message-id`` header, else its decimal sequence number."""
        for name, value in self.headers:
            if name == HEADER_MESSAGE_ID and value:
                try:
                    return value.decode()
                except UnicodeDecodeError:
                    break
        return str(self.sequence_number)


def _consumer(kafka_config: Mapping[str, Any], group: str) -> Consumer:
    return Consumer({**connection_settings(kafka_config), "group.id": group, "enable.auto.commit": False,
                     "auto.offset.reset": "earliest", "logger": logging.getLogger("ordering_layer.kafka.dlq")})


def _read(consumer: Consumer, topic: str, starts: dict[int, int], ends: dict[int, int]) -> list[DeadLetter]:
    consumer.assign([TopicPartition(topic, p, starts[p]) for p in ends if starts[p] < ends[p]])
    letters: list[DeadLetter] = []
    remaining = {p for p in ends if starts[p] < ends[p]}
    deadline = time.monotonic() + _TIMEOUT
    while remaining and time.monotonic() < deadline:
        for msg in consumer.consume(500, 0.5):
            if msg.error() is not None:
                raise KafkaException(msg.error())
            partition, offset = msg.partition(), msg.offset()
            assert partition is not None and offset is not None
            try:
                record = decode("dead_letter", msg.value() or b"")
            except RecordFormatError:
                _LOGGER.warning("dead-letter record %s:%d:%d is not a DeadLetter record", topic, partition, offset)
            else:
                letters.append(DeadLetter(
                    partition, offset, record["source_topic"], record["source_partition"], record["source_offset"],
                    record["sequence_number"], record["subscription"], record["reason"],
                    record["delivery_attempts"], record["last_error"], record["key"], record["value"],
                    [(h["key"], h["value"]) for h in record["headers"]]))
            if offset + 1 >= ends[partition]:
                remaining.discard(partition)
    return sorted(letters, key=lambda d: (d.dead_letter_partition, d.dead_letter_offset))


def _ends(consumer: Consumer, topic: str) -> dict[int, int]:
    partitions = retrying(lambda: consumer.list_topics(topic, timeout=_TIMEOUT).topics[topic].partitions)
    return {p: watermarks(consumer, topic, p, _TIMEOUT)[1] for p in partitions}


def list_dead_letters(kafka_config: Mapping[str, Any], topic: str) -> list[DeadLetter]:
    """Every record in the dead-letter ``topic``, in dead-letter order."""
    consumer = _consumer(kafka_config, f"ordering-layer-dlq-list-{uuid.uuid4().hex}")
    try:
        ends = _ends(consumer, topic)
        lows = {p: watermarks(consumer, topic, p, _TIMEOUT)[0] for p in ends}
        return _read(consumer, topic, lows, ends)
    finally:
        consumer.close()


def redrive(kafka_config: Mapping[str, Any], subscription: str, dead_letter_topic: str,
            target_topic: str | None = None) -> list[DeadLetter]:
    """Republish the dead letters not redriven before; return them in the order republished.

    Keyed records are routed like ``OrderedProducer`` does (murmur2 over the target's partition
    count, stamped in ``ol-partition-count``); their message ids are kept.
    """
    group = f"{subscription}.redrive"
    consumer = _consumer(kafka_config, group)
    producer = Producer({**connection_settings(kafka_config),
                         "enable.idempotence": True, "acks": "all",
                         "logger": logging.getLogger("ordering_layer.kafka.dlq")})
    try:
        ends = _ends(consumer, dead_letter_topic)
        committed = consumer.committed([TopicPartition(dead_letter_topic, p) for p in ends], timeout=_TIMEOUT)
        starts = {tp.partition: tp.offset if tp.offset >= 0 else OFFSET_BEGINNING for tp in committed}
        lows = {p: watermarks(consumer, dead_letter_topic, p, _TIMEOUT)[0] for p in ends}
        starts = {p: lows[p] if starts[p] < 0 else starts[p] for p in ends}
        letters = _read(consumer, dead_letter_topic, starts, ends)
        failures: list[str] = []
        for letter in letters:
            topic = target_topic or letter.source_topic
            if not topic:
                raise ConfigError("dead letter without a source topic: name target_topic")
            count = len(producer.list_topics(topic, timeout=_TIMEOUT).topics[topic].partitions)
            headers = [(k, v) for k, v in letter.headers if k not in (HEADER_PARTITION_COUNT, HEADER_MESSAGE_ID)]
            headers.append((HEADER_PARTITION_COUNT, str(count).encode()))
            headers.append((HEADER_MESSAGE_ID, letter.message_id.encode()))
            kwargs: dict[str, Any] = {"headers": headers, "key": letter.key,
                                      "on_delivery": lambda err, _m: failures.append(str(err)) if err else None}
            if letter.key:
                kwargs["partition"] = partition_for(letter.key, count)
            producer.produce(topic, letter.value, **kwargs)
        if producer.flush(_TIMEOUT) or failures:
            raise PublishError(f"redrive of {subscription} failed: {failures[:3]}", topic=target_topic or "",
                               ordering_key=None)
        if letters:
            consumer.commit(offsets=[TopicPartition(dead_letter_topic, p, ends[p]) for p in ends],
                            asynchronous=False)
        return letters
    finally:
        consumer.close()
