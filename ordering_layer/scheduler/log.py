"""The schedule topic: a compacted Kafka topic of the layer's schedule records (PUB-5).

Keyed by schedule id; the last record of an id is its state (``schemas/schedule.avsc``), a
tombstone forgets it. Writes wait for the broker's acknowledgement (``acks=all``), so a schedule
exists durably once ``schedule()`` returns; the topic is read from the start to rebuild a lost
Redis index.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Producer, TopicPartition

from ordering_layer.admin import Admin
from ordering_layer.errors import ConfigError, PublishError, RecordFormatError, TopicError
from ordering_layer.scheduler.records import ScheduledMessage

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


class ScheduleLog:
    """Writes and reads the schedule topic.

    Args:
        kafka_config: confluent-kafka settings (``bootstrap.servers`` at least).
        topic: the schedule topic, created on first use (compacted, broker append time).
    """

    def __init__(self, kafka_config: Mapping[str, Any], topic: str) -> None:
        self._config = dict(kafka_config)
        self.topic = topic
        self._lock = threading.Lock()
        self._producer: Producer | None = None
        self._ready = False

    def _writer(self) -> Producer:
        with self._lock:
            if self._producer is None:
                conf = {**producer_config(self._config), "enable.idempotence": True, "acks": "all",
                        "linger.ms": 2, "logger": logging.getLogger("ordering_layer.kafka.schedule")}
                try:
                    self._producer = Producer(conf)
                except KafkaException as exc:
                    raise ConfigError(f"Kafka producer config refused: {exc.args[0]}") from exc
            return self._producer

    def ensure_topic(self) -> None:
        """Create the schedule topic unless it exists. Raises ``TopicError`` when it cannot."""
        if self._ready:
            return
        admin = Admin(producer_config(self._config))
        try:
            described = admin.describe_topic(self.topic)
        except TopicError:
            described = admin.create_topic(self.topic, partitions=1, config=_TOPIC_CONFIG, exist_ok=True)
        if described.config.get("cleanup.policy", "compact") != "compact":
            raise TopicError(f"schedule topic {self.topic!r} must have cleanup.policy=compact", topic=self.topic)
        self._ready = True

    def write(self, records: Sequence[ScheduledMessage], timeout: float = _TIMEOUT) -> None:
        """Write records and wait until the broker has them all.

        Raises:
            PublishError: a record was refused or not acknowledged within ``timeout`` seconds.
        """
        self._send([(r.schedule_id, r.encode()) for r in records], timeout)

    def forget(self, schedule_ids: Sequence[str], timeout: float = _TIMEOUT) -> None:
        """Write tombstones for ``schedule_ids`` (compaction then drops them)."""
        self._send([(i, None) for i in schedule_ids], timeout)

    def _send(self, pairs: Sequence[tuple[str, bytes | None]], timeout: float) -> None:
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
            raise PublishError(f"write to schedule topic {self.topic!r} failed: {reason}",
                               topic=self.topic, ordering_key=None)

    def read_all(self) -> dict[str, ScheduledMessage]:
        """The last record of every schedule id not forgotten, read from the start of the topic."""
        self.ensure_topic()
        consumer = Consumer({**client_config(self._config, _PRODUCER_ONLY),
                             "group.id": f"ordering-layer-schedule-rebuild-{uuid.uuid4().hex}",
                             "enable.auto.commit": False, "enable.partition.eof": False,
                             "logger": logging.getLogger("ordering_layer.kafka.schedule")})
        latest: dict[str, ScheduledMessage] = {}
        try:
            partitions = consumer.list_topics(self.topic, timeout=_TIMEOUT).topics[self.topic].partitions
            ends = {p: consumer.get_watermark_offsets(TopicPartition(self.topic, p), timeout=_TIMEOUT)[1]
                    for p in partitions}
            remaining = {p for p, end in ends.items() if end > 0}
            consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in remaining])
            deadline = time.monotonic() + 10 * _TIMEOUT
            while remaining:
                if time.monotonic() > deadline:
                    raise TopicError(f"reading schedule topic {self.topic!r} timed out", topic=self.topic)
                for msg in consumer.consume(1000, 0.5):
                    if msg.error() is not None:
                        raise TopicError(f"reading {self.topic!r}: {msg.error()}", topic=self.topic)
                    self._fold(latest, msg.key(), msg.value())
                    partition, offset = msg.partition(), msg.offset()
                    if partition is not None and offset is not None and offset + 1 >= ends[partition]:
                        remaining.discard(partition)
        finally:
            consumer.close()
        return latest

    def _fold(self, latest: dict[str, ScheduledMessage], key: bytes | None, value: bytes | None) -> None:
        if not key:
            return
        schedule_id = key.decode("utf-8", "replace")
        if value is None:
            latest.pop(schedule_id, None)
            return
        try:
            latest[schedule_id] = ScheduledMessage.decode(value)
        except RecordFormatError:
            _LOGGER.warning("schedule topic %s: record of %r is not a Schedule record", self.topic, schedule_id)

    def close(self, timeout: float = _TIMEOUT) -> None:
        """Flush what is in flight."""
        with self._lock:
            producer, self._producer = self._producer, None
        if producer is not None:
            producer.flush(timeout)
