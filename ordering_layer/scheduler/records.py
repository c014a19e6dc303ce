"""The schedule records (``schemas/schedule.avsc``) and the typed results of the scheduler API."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from ordering_layer.errors import ConfigError
from ordering_layer.record import decode, encode

SCHEMA = "schedule"


class ScheduleState(enum.Enum):
    """The state of a schedule id; the last record of the id in the schedule topic holds it."""

    PENDING = "PENDING"
    ACTIVATED = "ACTIVATED"
    CANCELLED = "CANCELLED"


class CancelResult(enum.Enum):
    """What ``cancel_scheduled`` did (PUB-5)."""

    CANCELLED = "cancelled"  # removed before activation (also for a repeated cancel)
    ALREADY_ENQUEUED = "already_enqueued"  # activated, or being activated: it is (or will be) published
    NOT_FOUND = "not_found"  # no such schedule id (or its terminal state is older than the retention)


def new_schedule_id() -> str:
    """A fresh schedule id (also the message id of the activated message)."""
    return uuid.uuid4().hex


def epoch_ms(when: datetime) -> int:
    """``when`` (timezone-aware) in milliseconds since the epoch. Raises ``ConfigError`` if naive."""
    if when.tzinfo is None:
        raise ConfigError("enqueue_at needs a timezone-aware datetime (e.g. datetime.now(UTC))")
    return int(when.timestamp() * 1000)


@dataclass(frozen=True)
class ScheduledMessage:
    """One schedule record: the message to publish at ``enqueue_at_ms`` and its state."""

    schedule_id: str
    topic: str
    data: bytes
    enqueue_at_ms: int
    scheduled_at_ms: int
    ordering_key: bytes | None = None
    attributes: dict[str, str] = field(default_factory=dict)
    state: ScheduleState = ScheduleState.PENDING
    done_at_ms: int | None = None

    @property
    def enqueue_at(self) -> datetime:
        """When the message becomes visible (UTC)."""
        return datetime.fromtimestamp(self.enqueue_at_ms / 1000, UTC)

    def finished(self, state: ScheduleState, at_ms: int) -> ScheduledMessage:
        """The terminal record of this schedule: ``state``, without the payload."""
        return replace(self, state=state, data=b"", done_at_ms=at_ms)

    def encode(self) -> bytes:
        """The record as schemaless Avro."""
        return encode(SCHEMA, {
            "schedule_id": self.schedule_id, "state": self.state.value, "topic": self.topic,
            "ordering_key": self.ordering_key, "data": self.data, "attributes": self.attributes,
            "enqueue_at_ms": self.enqueue_at_ms, "scheduled_at_ms": self.scheduled_at_ms,
            "done_at_ms": self.done_at_ms})

    @staticmethod
    def decode(payload: bytes) -> ScheduledMessage:
        """A record read back. Raises ``RecordFormatError`` when ``payload`` is not one."""
        raw = decode(SCHEMA, payload)
        return ScheduledMessage(
            schedule_id=raw["schedule_id"], topic=raw["topic"], data=raw["data"],
            enqueue_at_ms=raw["enqueue_at_ms"], scheduled_at_ms=raw["scheduled_at_ms"],
            ordering_key=raw["ordering_key"], attributes=dict(raw["attributes"]),
            state=ScheduleState(raw["state"]), done_at_ms=raw["done_at_ms"])
