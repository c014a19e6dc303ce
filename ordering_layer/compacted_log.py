"""A compacted Kafka topic of the layer's own records, keyed by a name (schedules, snapshots).

The last record of a key is its value; a tombstone (null value) forgets it. Writes wait for the
broker's acknowledgement (``acks=all``), so a record exists durably once ``write`` returns; the
topic is read from its start to learn every key's last value.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Producer, TopicPartition

from ordering_layer.errors import ConfigError, PublishError, TopicError

if TYPE_CHECKING:
    from ordering_layer.admin import TopicDescription

_LOGGER = logging.getLogger(__name__)

_TIMEOUT = 30.0
_TOPIC_CONFIG = {"cleanup.policy": "compact"}
# Settings of one side that the other side's client would only warn about.
_CONSUMER_ONLY = ("group.", "enable.auto.", "auto.", "session.timeout.ms", "heartbeat.interval.ms",
                  "max.poll.interval.ms", "isolation.level", "fetch.", "partition.assignment.strategy",
                  "enable.partition.eof", "queued.", "on_commit", "check.crcs")
_PRODUCER_ONLY = ("acks", "enable.idempotence", "linger.ms", "batch.", "queue.buffering.", "compression.",
                  "retries", "message.send.max.retries", "delivery.timeout.ms", "request.required.acks",
                  "transactional.id", "partitioner", "sticky.")


def client_config(config: Mapping[str, Any], other_side: Iterable[str]) -> dict[str, Any]:
    """``config`` without the settings that belong to the other kind of Kafka client."""
    prefixes = tuple(other_side)
    return {k: v for k, v in config.items() if not k.startswith(prefixes)}


def producer_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A consumer's or producer's config, cut down for a producer."""
    return client_config(config, _CONSUMER_ONLY)


def consumer_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A consumer's or producer's config, cut down for a consumer."""
    return client_config(config, _PRODUCER_ONLY)


class TopicAdmin(Protocol):
    """What the log needs to create its topic (``ordering_layer.Admin`` has it)."""

    def describe_topic(self, name: str) -> TopicDescription:
        """Describe a topic; ``TopicError`` when it does not exist."""

    def create_topic(self, name: str, partitions: int = 1, *, replication_factor: int | None = None,
                     config: Mapping[str, str] | None = None, exist_ok: bool = False) -> TopicDescription:
        """Create a topic."""


class CompactedLog:
    """Writes and reads one compacted topic.

    Args:
        kafka_config: confluent-kafka settings (``bootstrap.servers`` at least).
        topic: the topic, created on first use (compacted, one partition, broker append time).
        admin: makes the ``Admin`` that creates the topic (called once, on first use).
        kind: what the records are, for logs and errors (``"schedule"``, ``"snapshot"``).
    """

    def __init__(self, kafka_config: Mapping[str, Any], topic: str, admin: Callable[[], TopicAdmin],
                 kind: str) -> None:
        self._config = dict(kafka_config)
        self.topic = topic
        self._admin = admin
        self.kind = kind
        self._lock = threading.Lock()
        self._producer: Producer | None = None
        self._ready = False

    def _writer(self) -> Producer:
        with self._lock:
            if self._producer is None:
                conf = {**producer_config(self._config), "enable.idempotence": True, "acks": "all",
                        "linger.ms": 2, "logger": logging.getLogger(f"ordering_layer.kafka.{self.kind}")}
                try:
                    self._producer = Producer(conf)
                except KafkaException as exc:
                    raise ConfigError(f"Kafka producer config refused: {exc.args[0]}") from exc
            return self._producer

    def ensure_topic(self) -> None:
        """Create the topic unless it exists. Raises ``TopicError`` when it cannot."""
        if self._ready:
            return
        admin = self._admin()
        try:
            described = admin.describe_topic(self.topic)
        except TopicError:
            described = admin.create_topic(self.topic, partitions=1, config=_TOPIC_CONFIG, exist_ok=True)
        if described.config.get("cleanup.policy", "compact") != "compact":
            raise TopicError(f"{self.kind} topic {self.topic!r} must have cleanup.policy=compact", topic=self.topic)
        self._ready = True

    def write(self, pairs: Sequence[tuple[str, bytes | None]], timeout: float = _TIMEOUT) -> None:
        """Write (key, value) records, a None value as a tombstone, and wait until the broker has them.

        Raises:
            PublishError: a record was refused or not acknowledged within ``timeout`` seconds.
        """
        if not pairs:
            return
        self.ensure_topic()
        producer = self._writer()
        failures: list[str] = []
        pending = [len(pairs)]

        def delivered(err: KafkaError | None, _msg: Any) -> None:
            pending[0] -= 1
            if err is not None:
                failures.append(err.str())

        for key, value in pairs:
            while True:
                try:
                    producer.produce(self.topic, value, key.encode(), on_delivery=delivered)
                    break
                except BufferError:
                    producer.poll(0.05)
                except KafkaException as exc:
                    raise PublishError(f"write to {self.topic!r} refused: {exc.args[0]}",
                                       topic=self.topic, ordering_key=None) from exc
        deadline = time.monotonic() + timeout
        while pending[0] > 0 and time.monotonic() < deadline:
            producer.poll(0.05)
        if failures or pending[0] > 0:
            reason = failures[0] if failures else f"no acknowledgement in {timeout:.0f} s"
            raise PublishError(f"write to {self.kind} topic {self.topic!r} failed: {reason}",
                               topic=self.topic, ordering_key=None)

    def read_all(self) -> dict[str, bytes]:
        """The last value of every key not forgotten, read from the start of the topic."""
        self.ensure_topic()
        consumer = Consumer({**consumer_config(self._config),
                             "group.id": f"ordering-layer-{self.kind}-read-{uuid.uuid4().hex}",
                             "enable.auto.commit": False, "enable.partition.eof": False,
                             "logger": logging.getLogger(f"ordering_layer.kafka.{self.kind}")})
        latest: dict[str, bytes] = {}
        try:
            partitions = consumer.list_topics(self.topic, timeout=_TIMEOUT).topics[self.topic].partitions
            ends = {p: consumer.get_watermark_offsets(TopicPartition(self.topic, p), timeout=_TIMEOUT)[1]
                    for p in partitions}
            remaining = {p for p, end in ends.items() if end > 0}
            consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in remaining])
            deadline = time.monotonic() + 10 * _TIMEOUT
            while remaining:
                if time.monotonic() > deadline:
                    raise TopicError(f"reading {self.kind} topic {self.topic!r} timed out", topic=self.topic)
                for msg in consumer.consume(1000, 0.5):
                    if msg.error() is not None:
                        raise TopicError(f"reading {self.topic!r}: {msg.error()}", topic=self.topic)
                    key, value = msg.key(), msg.value()
                    if key:
                        name = key.decode("utf-8", "replace")
                        if value is None:
                            latest.pop(name, None)
                        else:
                            latest[name] = value
                    partition, offset = msg.partition(), msg.offset()
                    if partition is not None and offset is not None and offset + 1 >= ends[partition]:
                        remaining.discard(partition)
        finally:
            consumer.close()
        return latest

    def close(self, timeout: float = _TIMEOUT) -> None:
        """Flush what is in flight."""
        with self._lock:
            producer, self._producer = self._producer, None
        if producer is not None:
            producer.flush(timeout)
