"""Reading topics back with a plain confluent-kafka consumer, as a user's own tools would."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition
from confluent_kafka import Message as KafkaMessage


def _client_config(kafka: str | Mapping[str, Any]) -> dict[str, Any]:
    """A client config of a bootstrap address (a plain broker) or a copy of a client config (with
    its security settings, as the session's ``kafka_config`` fixture gives them)."""
    return {"bootstrap.servers": kafka} if isinstance(kafka, str) else dict(kafka)


def read_topic(kafka: str | Mapping[str, Any], topic: str, expected: int, timeout: float = 60.0) -> list[KafkaMessage]:
    """Every record of ``topic`` from the start, waiting until ``expected`` have arrived.

    ``kafka`` is a bootstrap address or a client config (with its security settings).
    """
    consumer = Consumer({**_client_config(kafka), "group.id": f"reader-{uuid.uuid4().hex}",
                         "enable.auto.commit": False})
    try:
        metadata = consumer.list_topics(topic, timeout=10)
        partitions = metadata.topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        records: list[KafkaMessage] = []
        deadline = time.monotonic() + timeout
        while len(records) < expected and time.monotonic() < deadline:
            for record in consumer.consume(1000, 0.5):
                if record.error() is not None:
                    raise KafkaException(record.error())
                records.append(record)
        return records
    finally:
        consumer.close()


def end_offsets(kafka: str | Mapping[str, Any], topic: str) -> dict[int, int]:
    """High watermark of each partition of ``topic``; ``kafka`` as for ``read_topic``."""
    consumer = Consumer({**_client_config(kafka), "group.id": f"offsets-{uuid.uuid4().hex}"})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in partitions}
    finally:
        consumer.close()


def headers_of(record: KafkaMessage) -> dict[str, Any]:
    """A record's headers as a dict."""
    return dict(record.headers() or [])
