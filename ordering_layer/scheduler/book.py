"""``ScheduleBook``: schedule, cancel, list and rebuild scheduled messages (PUB-5).

A schedule is written to the schedule topic first (durable once ``schedule`` returns), then indexed
for time in Redis. Cancel is decided in Redis (only an unclaimed message can be cancelled) and the
terminal state is then written to the topic.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from ordering_layer.errors import ConfigError, InvalidMessageError
from ordering_layer.record import attribute_headers, encode_ordering_key, now_ms
from ordering_layer.scheduler.index import ScheduleIndex
from ordering_layer.scheduler.log import ScheduleLog
from ordering_layer.scheduler.records import (
    CancelResult,
    ScheduledMessage,
    ScheduleState,
    epoch_ms,
    new_schedule_id,
)
from ordering_layer.scheduler.settings import SchedulerSettings

_LOGGER = logging.getLogger(__name__)

_REBUILD_WAIT = 60.0


class ScheduleBook:
    """The scheduled messages of one schedule topic: its Kafka log and its Redis time index.

    Args:
        kafka_config: confluent-kafka settings (``bootstrap.servers`` at least).
        redis_url: the Redis holding the time index.
        settings: ``SchedulerSettings`` (the schedule topic, leases, retention).
    """

    def __init__(self, kafka_config: Mapping[str, Any], redis_url: str,
                 settings: SchedulerSettings | None = None) -> None:
        self.settings = settings or SchedulerSettings()
        self.log = ScheduleLog(kafka_config, self.settings.schedule_topic)
        self.index = ScheduleIndex(redis_url, self.settings.schedule_topic)

    def schedule(self, topic: str, data: bytes, ordering_key: str | bytes | None = None,
                 attributes: Mapping[str, str] | None = None, *, enqueue_at: datetime) -> str:
        """Store a message to publish to ``topic`` at ``enqueue_at``; return its schedule id.

        Raises:
            ConfigError: ``enqueue_at`` is not timezone-aware.
            InvalidOrderingKeyError, InvalidMessageError: bad key, data or attributes (PUB-4).
            PublishError: the schedule topic did not acknowledge the record.
        """
        _, key_raw = encode_ordering_key(ordering_key)
        if attributes:
            attribute_headers(attributes)  # the checks publish applies, before anything is stored
        if not isinstance(data, bytes | bytearray | memoryview):
            raise InvalidMessageError(f"data must be bytes, not {type(data).__name__}")
        message = ScheduledMessage(
            schedule_id=new_schedule_id(), topic=topic, data=bytes(data), enqueue_at_ms=epoch_ms(enqueue_at),
            scheduled_at_ms=now_ms(), ordering_key=key_raw, attributes=dict(attributes or {}))
        self.log.write([message])
        self.index.add(message)
        return message.schedule_id

    def cancel(self, schedule_id: str) -> CancelResult:
        """Cancel a scheduled message if no scheduler has claimed it yet (PUB-5).

        Returns ``CANCELLED`` (also for a repeated cancel), ``ALREADY_ENQUEUED`` (activated, or
        being activated) or ``NOT_FOUND``. Raises ``PublishError`` when the cancellation was
        decided but its record could not be written to the schedule topic (a rebuild of the
        index would then bring the message back).
        """
        decided = self.index.cancel(schedule_id, now_ms())
        if decided.result is None:
            self.rebuild()
            decided = self.index.cancel(schedule_id, now_ms())
        if decided.record is not None:
            self.log.write([decided.record.finished(ScheduleState.CANCELLED, now_ms())])
        return decided.result or CancelResult.NOT_FOUND

    def pending(self) -> list[tuple[ScheduledMessage, bool]]:
        """Scheduled messages not yet activated nor cancelled, by ``enqueue_at``; True when one is
        being activated (claimed by a scheduler)."""
        if not self.index.is_built():
            self.rebuild()
        return self.index.pending()

    def rebuild(self) -> bool:
        """Rebuild the Redis index from the schedule topic if it is missing (lost or flushed Redis).

        One scheduler rebuilds at a time; the others wait for it (up to a minute). Returns True
        when this call rebuilt the index.
        """
        deadline = time.monotonic() + _REBUILD_WAIT
        while not self.index.is_built():
            if self.index.lock_rebuild():
                try:
                    records = self.log.read_all()
                    self.index.restore(list(records.values()))
                    self.index.mark_built()
                finally:
                    self.index.unlock_rebuild()
                _LOGGER.info("schedule index %s rebuilt from %d records", self.settings.schedule_topic,
                             len(records))
                return True
            if time.monotonic() > deadline:
                raise ConfigError(f"schedule index {self.settings.schedule_topic!r} is still being rebuilt")
            time.sleep(0.1)
        return False

    def close(self) -> None:
        """Flush the schedule topic's writer."""
        self.log.close()
