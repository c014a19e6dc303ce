"""Backlog per partition (log end minus committed offset), read from Kafka and cached for scrapes."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaException

from ordering_layer.kafka.offsets import partition_offsets
from ordering_layer.kafka_config import connection_settings

_LOGGER = logging.getLogger(__name__)

_KAFKA_TIMEOUT = 2.0  # a scrape must answer within Prometheus' scrape timeout (10 s by default)


class BacklogReader:
    """The backlog of one subscription, read at most every ``ttl`` seconds.

    Args:
        kafka_config: confluent-kafka settings of the cluster (``bootstrap.servers`` and security).
        subscription: the subscription (its consumer group, which this reader never joins).
        topic: the subscription's topic.
        ttl: seconds a reading is served from the cache.
    """

    def __init__(self, kafka_config: Mapping[str, Any], subscription: str, topic: str, ttl: float = 5.0) -> None:
        conf = connection_settings(kafka_config)
        conf.update({"group.id": subscription, "enable.auto.commit": False})
        conf.setdefault("logger", logging.getLogger("ordering_layer.kafka.metrics"))
        self._conf = conf
        self._topic = topic
        self._ttl = ttl
        self._lock = threading.Lock()
        self._consumer: Consumer | None = None
        self._expires = 0.0
        self._backlog: dict[int, int] = {}
        self._asked: set[int] = set()  # partitions of the last reading (newly owned ones are read at once)

    def backlog(self, partitions: list[int]) -> dict[int, int]:
        """Backlog of ``partitions`` (those read successfully; none while Kafka does not answer)."""
        with self._lock:
            wanted = set(partitions)
            if time.monotonic() >= self._expires or not wanted <= self._asked:
                self._asked = wanted
                self._backlog = self._read(sorted(wanted))
                self._expires = time.monotonic() + self._ttl
            return {p: n for p, n in self._backlog.items() if p in wanted}

    def _read(self, partitions: list[int]) -> dict[int, int]:
        try:
            if self._consumer is None:
                self._consumer = Consumer(self._conf)
            rows = partition_offsets(self._consumer, self._topic, partitions, _KAFKA_TIMEOUT)
        except KafkaException as exc:
            _LOGGER.warning("backlog of %s not read: %s", self._conf["group.id"], exc.args[0])
            return {}
        return {row.partition: row.backlog for row in rows}

    def close(self) -> None:
        """Close the Kafka consumer."""
        with self._lock:
            if self._consumer is not None:
                self._consumer.close()
                self._consumer = None
