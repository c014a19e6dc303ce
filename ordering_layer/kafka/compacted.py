"""``CompactedTopic``: a compacted Kafka topic of the layer's own records, keyed by name.

The last record of a key is its state and a tombstone (null value) forgets the key; compaction
keeps the topic as small as the set of live keys. Writes wait for the broker's acknowledgement
(``acks=all``, idempotent), so a record is durable once ``send`` returns; ``read_all`` reads the
topic from the start. The schedule topic (PUB-5) and the durable copy of subscription settings
are such topics.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Producer, TopicPartition

from ordering_layer.errors import ConfigError, PublishError, TopicError
from ordering_layer.kafka.auth import verify_kafka
from ordering_layer.kafka.topics import Topics
from ordering_layer.kafka_config import connection_settings

_LOGGER = logging.getLogger(__name__)

_TIMEOUT = 30.0
_TOPIC_CONFIG = {"cleanup.policy": "compact"}
class CompactedTopic:
    """Writes and reads one compacted topic of the layer's records.

    Args:
        kafka_config: confluent-kafka settings (``bootstrap.servers`` at least; ``security.protocol``,
            ``sasl.*`` and ``ssl.*`` pass through: ``connection_settings``); the topic's own clients
            take nothing else from it.
        topic: the topic, created on first write (one partition, compacted, broker append time).
        what: what its records are, for messages and the Kafka client's logger name.
    """

    def __init__(self, kafka_config: Mapping[str, Any], topic: str, what: str) -> None:
        self._config = dict(kafka_config)
        self.topic = topic
        self._what = what
        self._logger = logging.getLogger(f"ordering_layer.kafka.{what}")
        self._lock = threading.Lock()
        self._producer: Producer | None = None
        self._ready = False

    def _writer(self) -> Producer:
        with self._lock:
            if self._producer is None:
                conf = {**connection_settings(self._config), "enable.idempotence": True, "acks": "all",
                        "linger.ms": 2, "logger": self._logger}
                try:
                    self._producer = Producer(conf)
                except KafkaException as exc:
                    raise ConfigError(f"Kafka producer config refused: {exc.args[0]}") from exc
            return self._producer

    def ensure_topic(self) -> None:
        """Create the topic unless it exists.

        Raises:
            TopicError: it cannot be created, or it exists without ``cleanup.policy=compact``.
        """
        if self._ready:
            return
        verify_kafka(connection_settings(self._config))
        topics = Topics(self._config)
        try:
            described = topics.describe(self.topic)
        except TopicError:
            described = topics.create(self.topic, partitions=1, config=_TOPIC_CONFIG, exist_ok=True)
        if described.config.get("cleanup.policy", "compact") != "compact":
            raise TopicError(f"{self._what} topic {self.topic!r} must have cleanup.policy=compact", topic=self.topic)
        self._ready = True

    def prepare(self) -> None:
        """Create the topic and the writer now, so that the first ``send`` waits for neither.

        Raises:
            ConfigError, TopicError: as ``send``.
        """
        self.ensure_topic()
        self._writer()

    def send(self, pairs: Sequence[tuple[str, bytes | None]], timeout: float = _TIMEOUT) -> None:
        """Write (key, value) records, a None value being a tombstone; wait until the broker has them all.

        Raises:
            PublishError: a record was refused or not acknowledged within ``timeout`` seconds.
            TopicError: the topic cannot be created.
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
                    self._discard(producer)
                    raise PublishError(f"write to {self._what} topic {self.topic!r} refused: {exc.args[0]}",
                                       topic=self.topic, ordering_key=None) from exc
        deadline = time.monotonic() + timeout
        while pending[0] > 0 and time.monotonic() < deadline:
            producer.poll(0.05)
        if failures or pending[0] > 0:
            self._discard(producer)
            reason = failures[0] if failures else f"no acknowledgement in {timeout:.0f} s"
            raise PublishError(f"write to {self._what} topic {self.topic!r} failed: {reason}",
                               topic=self.topic, ordering_key=None)

    def _discard(self, producer: Producer) -> None:
        """Drop a writer whose write failed: the next ``send`` makes a new one (an idempotent
        producer that hit a fatal error, after a broker was lost mid-write, refuses every later
        record; what it still holds is not waited for)."""
        with self._lock:
            if self._producer is producer:
                self._producer = None
        _LOGGER.warning("%s topic %s: the writer is made again after a failed write", self._what, self.topic)

    def read_all(self) -> dict[str, bytes]:
        """The last value of every key not forgotten, read from the start; empty when the topic is absent.

        Raises:
            TopicError: the topic cannot be read within ten times the Kafka timeout.
        """
        consumer = Consumer({**connection_settings(self._config),
                             "group.id": f"ordering-layer-{self._what}-read-{uuid.uuid4().hex}",
                             "enable.auto.commit": False, "enable.partition.eof": False,
                             "logger": self._logger})
        latest: dict[str, bytes] = {}
        try:
            described = consumer.list_topics(self.topic, timeout=_TIMEOUT).topics.get(self.topic)
            if described is None or described.error is not None:
                return latest
            ends = {p: consumer.get_watermark_offsets(TopicPartition(self.topic, p), timeout=_TIMEOUT)[1]
                    for p in described.partitions}
            remaining = {p for p, end in ends.items() if end > 0}
            consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in remaining])
            deadline = time.monotonic() + 10 * _TIMEOUT
            while remaining:
                if time.monotonic() > deadline:
                    raise TopicError(f"reading {self._what} topic {self.topic!r} timed out", topic=self.topic)
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
