"""The schedule topic: a compacted Kafka topic of the layer's schedule records (PUB-5).

Keyed by schedule id; the last record of an id is its state (``schemas/schedule.avsc``), a
tombstone forgets it. A schedule exists durably once ``schedule()`` returns; the topic is read
from the start to rebuild a lost Redis index.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ordering_layer.errors import RecordFormatError
from ordering_layer.kafka.compacted import CompactedTopic
from ordering_layer.scheduler.records import ScheduledMessage

_LOGGER = logging.getLogger(__name__)

_TIMEOUT = 30.0


class ScheduleLog:
    """Writes and reads the schedule topic.

    Args:
        kafka_config: confluent-kafka settings (``bootstrap.servers`` at least).
        topic: the schedule topic, created on first use (compacted, broker append time).
    """

    def __init__(self, kafka_config: Mapping[str, Any], topic: str) -> None:
        self._topic = CompactedTopic(kafka_config, topic, "schedule")
        self.topic = topic

    def ensure_topic(self) -> None:
        """Create the schedule topic unless it exists. Raises ``TopicError`` when it cannot."""
        self._topic.ensure_topic()

    def write(self, records: Sequence[ScheduledMessage], timeout: float = _TIMEOUT) -> None:
        """Write records and wait until the broker has them all.

        Raises:
            PublishError: a record was refused or not acknowledged within ``timeout`` seconds.
        """
        self._topic.send([(r.schedule_id, r.encode()) for r in records], timeout)

    def forget(self, schedule_ids: Sequence[str], timeout: float = _TIMEOUT) -> None:
        """Write tombstones for ``schedule_ids`` (compaction then drops them)."""
        self._topic.send([(i, None) for i in schedule_ids], timeout)

    def read_all(self) -> dict[str, ScheduledMessage]:
        """The last record of every schedule id not forgotten, read from the start of the topic."""
        self._topic.ensure_topic()
        latest: dict[str, ScheduledMessage] = {}
        for schedule_id, value in self._topic.read_all().items():
            try:
                latest[schedule_id] = ScheduledMessage.decode(value)
            except RecordFormatError:
                _LOGGER.warning("schedule topic %s: record of %r is not a Schedule record", self.topic, schedule_id)
        return latest

    def close(self, timeout: float = _TIMEOUT) -> None:
        """Flush what is in flight."""
        self._topic.close(timeout)
