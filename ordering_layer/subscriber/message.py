"""``Message``: one delivery, with Pub/Sub fields and confluent-kafka ``Message`` accessors.

A ``Message`` is the engine's ``Delivery`` itself (made at release, by the core:
``PartitionCore.release_messages``), so a message handed to user code is one object, not a wrapper
around another; ``lease`` names it in the engine's ``LeaseTable`` while it is outstanding.
``Delivery`` is compiled (``core/src/delivery.rs``): its fields, ``settled`` and ``ack`` are there, so
a plain ack runs no Python (it goes to the engine's ``AckQueue``); this class adds the accessors.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from datetime import UTC, datetime

from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME, KafkaError

from ordering_layer._core import ack_queued_all
from ordering_layer.record import HeaderPairs, attributes_of, display_key
from ordering_layer.subscriber.records import Delivery
from ordering_layer.subscriber.requests import Settle, SettleKind

_ACK, _NACK, _DEADLINE = SettleKind.ACK, SettleKind.NACK, SettleKind.DEADLINE
NACKED = 2  # ``Message.settled`` after a nack (True after an ack)


class AckResponse(enum.Enum):
    """Whether an ack, nack or deadline change took effect (ACK-5)."""

    SUCCESS = "SUCCESS"
    INVALID_ACK_ID = "INVALID_ACK_ID"
    LEASE_LOST = "LEASE_LOST"
    OTHER = "OTHER"


def unattached(_: Settle | Message | list[Message]) -> None:
    """Where the answers of a message no subscriber released would go: nowhere (an error)."""
    raise RuntimeError("this message was not released by a subscriber")


class Message(Delivery):
    """A delivered message: a Kafka record, with Pub/Sub fields and confluent-kafka accessors.

    Pub/Sub fields: ``data`` (the record value; empty for a null value), ``attributes`` (headers
    outside ``ol-`` with UTF-8 values), ``ordering_key`` (the record key as text, see
    ``record.display_key``; empty when unordered), ``message_id`` (the ``ol-message-id`` header, else
    the decimal sequence number), ``sequence_number``, ``enqueued_time``, ``delivery_attempt``;
    methods ``ack``, ``nack``, ``modify_ack_deadline``, ``ack_with_response``. confluent-kafka
    accessors return the record as fetched: ``key()``, ``value()``, ``headers()``, ``topic()``,
    ``partition()``, ``offset()``, ``timestamp()``, ``error()``.
    """

    # ``Message(record, queue_key, token, attempt, topic, epoch, submit=None, lease=0)`` (``Delivery``'s
    # constructor; the subscriber's releases make messages in the core). ``settled``: False; True once
    # an ack was sent; NACKED once a nack was, and so whatever comes after it (a key's run never goes on
    # past a nacked message, ``runs``); the answer may still be pending.
    __slots__ = ()

    ack = Delivery.ack
    """Done with the message: it is settled and never delivered again (unless a cascade). Compiled: a
    message's first request, when it is this, goes to its engine's ack queue without running Python."""

    @property
    def data(self) -> bytes:
        """The record value (empty for a null value)."""
        return self.record.value or b""

    @property
    def delivery_attempt(self) -> int:
        """Which delivery of the record this is (1 the first; crashes of earlier owners count, ACK-6)."""
        return self.attempt

    @property
    def attributes(self) -> dict[str, str]:
        """The record's headers outside ``ol-`` whose values are UTF-8 text (trace context headers
        such as ``traceparent`` included, see ``ordering_layer.tracing``)."""
        return attributes_of(self.record.headers)

    @property
    def ordering_key(self) -> str:
        """The ordering key as text (bytes that are not UTF-8 as ``\\xNN``); empty when unordered.
        ``key()`` gives the exact bytes, which are what the layer orders by."""
        return display_key(self.record.key)

    @property
    def message_id(self) -> str:
        """The ``ol-message-id`` header when the publisher set one, else the decimal sequence number."""
        record = self.record
        return record.metadata.message_id or str((record.partition << 48) | record.offset)

    @property
    def sequence_number(self) -> int:
        """``partition << 48 | offset`` (PUB-3)."""
        record = self.record
        return (record.partition << 48) | record.offset

    @property
    def enqueued_time(self) -> datetime:
        """The broker's append time (UTC)."""
        return datetime.fromtimestamp(self.record.timestamp_ms / 1000, tz=UTC)

    @property
    def size(self) -> int:
        """Payload size in bytes (what flow control counts)."""
        return len(self.data)

    def _send(self, kind: int, seconds: float = 0.0, error: str | None = None,
              future: Future[AckResponse] | None = None) -> None:
        self._mark(kind)
        submit = self._submit
        if submit is None:
            unattached(self)
        submit(Settle(kind, self, self._epoch, seconds, error, future))

    def ack_with_response(self) -> Future[AckResponse]:
        """Ack and learn whether it took effect (SUCCESS once written to Redis by the owner)."""
        future: Future[AckResponse] = Future()
        self._send(_ACK, future=future)
        return future

    def nack(self, error: str | None = None) -> None:
        """Give the message back now; it and its key's later delivered messages come again (SUB-4)."""
        self._send(_NACK, error=error)

    def nack_with_response(self, error: str | None = None) -> Future[AckResponse]:
        """Nack and learn whether it took effect."""
        future: Future[AckResponse] = Future()
        self._send(_NACK, error=error, future=future)
        return future

    def modify_ack_deadline(self, seconds: float) -> None:
        """Set this delivery's deadline to ``seconds`` from now (0 nacks; ACK-3)."""
        if seconds <= 0:
            self._send(_NACK)
        else:
            self._send(_DEADLINE, seconds=min(float(seconds), 600.0))

    # -- confluent-kafka Message shape --------------------------------------------------------------
    def key(self) -> bytes | None:
        """The record key as fetched (the ordering key's bytes; None when the record has none)."""
        return self.record.key

    def value(self) -> bytes | None:
        """The record value as fetched (the payload; None for a null value)."""
        return self.record.value

    def headers(self) -> HeaderPairs | None:
        """The record's headers as fetched (``ol-`` metadata included); None when it has none."""
        headers = self.record.headers
        return None if headers is None else list(headers)  # a fresh list per call, as confluent-kafka's

    def topic(self) -> str:
        """The source topic."""
        return self._topic

    def partition(self) -> int:
        """The source partition."""
        return self.record.partition

    def offset(self) -> int:
        """The source offset."""
        return self.record.offset

    def timestamp(self) -> tuple[int, int]:
        """(TIMESTAMP_LOG_APPEND_TIME, epoch milliseconds)."""
        return TIMESTAMP_LOG_APPEND_TIME, self.record.timestamp_ms

    def error(self) -> KafkaError | None:
        """Always None: fetch errors are handled by the subscriber, never returned as messages."""
        return None

    def __repr__(self) -> str:
        return (f"Message(ordering_key={self.ordering_key!r}, message_id={self.message_id!r}, "
                f"sequence_number={self.sequence_number}, delivery_attempt={self.delivery_attempt})")


def ack_all(messages: Iterable[Message]) -> None:
    """Ack many messages as ``Message.ack`` would each: the first request of a released message goes
    to its engine's ack queue (``ack_queued_all``: no Python per message; the engine is woken once,
    and settles the queue in one call); the rest go to their engine's inbox as one list per engine
    (settled as a run of plain acks)."""
    batches: dict[Callable[[Settle | Message | list[Message]], None], list[Message]] = {}
    for message in ack_queued_all(messages):
        submit = message._submit
        if submit is None:
            unattached(message)
        batches.setdefault(submit, []).append(message)
    for submit, batch in batches.items():
        submit(batch)
