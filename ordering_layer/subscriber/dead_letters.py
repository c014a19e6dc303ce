"""Dead-lettering: the record goes to the subscription's dead-letter topic (DLQ-2, DLQ-3, DLQ-4).

A delivery whose attempt would exceed ``max_delivery_attempts``, or whose key is parked, is written to
the dead-letter topic (value: the ``dead_letter`` Avro record; headers naming source, sequence number,
key, attempts, last error, subscription and reason). It counts as settled only when the broker has it:
the producer's delivery report comes back as a ``DeadLettered`` request. In ``park_key`` mode the
key is parked on the first message that ran out of attempts, so its later messages follow it in
order until the key is released.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import redis
from confluent_kafka import KafkaError, KafkaException, Producer

from ordering_layer.config import DEAD_LETTER_MAX_BYTES, SubscriptionSettings
from ordering_layer.kafka_config import connection_settings
from ordering_layer.record import display_key, encode
from ordering_layer.state import StateStore
from ordering_layer.subscriber.records import Delivery
from ordering_layer.subscriber.requests import DeadLettered

_LOGGER = logging.getLogger(__name__)

DLQ_HEADERS = ("ol-dlq-source-topic", "ol-dlq-source-partition", "ol-dlq-source-offset",
               "ol-dlq-sequence-number", "ol-dlq-key", "ol-dlq-attempts", "ol-dlq-last-error",
               "ol-dlq-subscription", "ol-dlq-reason")

HEADER_PAYLOAD_DROPPED = "ol-dlq-payload-dropped"
_TOO_LARGE = (KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE)

MAX_DELIVERY_ATTEMPTS = "MAX_DELIVERY_ATTEMPTS"
PARKED_KEY = "PARKED_KEY"


def _header_bytes(value: str | bytes | None) -> bytes | None:
    return value.encode() if isinstance(value, str) else value


class DeadLetters:
    """The dead-letter side of one engine (coordinator thread; the producer is made on first use).

    Args:
        kafka_config: the subscriber's Kafka settings (consumer-only keys are left out).
        store: the Redis state store (parked keys).
        subscription: subscription name.
        settings: the subscription's settings (its dead-letter policy).
        report: receives each ``DeadLettered`` outcome (from the producer's poll).
    """

    def __init__(self, kafka_config: Mapping[str, Any], store: StateStore, subscription: str,
                 settings: SubscriptionSettings, report: Callable[[DeadLettered], None]) -> None:
        self._producer_config = connection_settings(kafka_config)
        self._store = store
        self._subscription = subscription
        self._settings = settings
        self._report = report
        self._producer: Producer | None = None
        self.parked: set[bytes] = set()
        self.written = 0  # dead letters the broker took
        policy = settings.dead_letter_policy
        self.max_attempts = policy.max_delivery_attempts if policy is not None else None

    def verdict(self, delivery: Delivery) -> str | None:
        """Why this delivery must go to the dead-letter topic instead of user code, or None."""
        if self.max_attempts is not None and delivery.attempt > self.max_attempts:
            return MAX_DELIVERY_ATTEMPTS
        if self.parked and delivery.record.key in self.parked:  # park_key adds to this set as it goes
            return PARKED_KEY
        return None

    def write(self, delivery: Delivery, epoch: int, reason: str) -> None:
        """Produce the record to the dead-letter topic; the outcome comes back through ``report``."""
        record = delivery.record
        policy = self._settings.dead_letter_policy
        assert policy is not None  # only attempts beyond a policy's maximum and parked keys come here
        topic, subscription = self._settings.topic, self._subscription
        attempts = delivery.attempt - 1
        last_error = record.last_error
        if (reason == MAX_DELIVERY_ATTEMPTS and policy.mode == "park_key"
                and record.key and self._settings.enable_message_ordering):
            self.parked.add(record.key)
            self._store.park_key(subscription, record.key)
        sequence = (record.partition << 48) | record.offset
        fields: dict[str, Any] = {
            "source_topic": topic, "source_partition": record.partition, "source_offset": record.offset,
            "sequence_number": sequence, "subscription": subscription, "reason": reason,
            "delivery_attempts": attempts, "last_error": last_error, "key": record.key,
            "value": record.value, "headers": [{"key": k, "value": _header_bytes(v)} for k, v in record.headers or ()]}
        facts = (topic, record.partition, record.offset, sequence,
                 display_key(record.key), attempts, last_error or "", subscription, reason)
        headers: list[tuple[str, str | bytes | None]] = [
            (name, str(fact).encode()) for name, fact in zip(DLQ_HEADERS, facts, strict=True)]
        outcome = (record.partition, epoch, delivery.queue_key, record.offset)
        self._produce(policy.topic, record.key, fields, headers, outcome, record.size)
        _LOGGER.warning("%s: dead-lettering %d:%d (%s, %d attempts)", subscription, record.partition,
                        record.offset, reason, attempts)

    def _produce(self, topic: str, key: bytes | None, fields: dict[str, Any],
                 headers: list[tuple[str, str | bytes | None]], outcome: tuple[int, int, Any, int], size: int,
                 *, payload: bool = True) -> None:
        """Send one dead letter. One that is too large even for the dead-letter topic is sent again
        with the facts alone (its payload stays at its source offset, named in the headers), so that
        an oversized record still settles (DLQ-4) instead of failing forever."""
        if self._producer is None:
            conf = {**self._producer_config, "enable.idempotence": True, "acks": "all",
                    "message.max.bytes": DEAD_LETTER_MAX_BYTES,
                    "logger": logging.getLogger("ordering_layer.kafka.dlq")}
            self._producer = Producer(conf)
        if not payload:
            note = f"payload of {size} bytes too large for a dead letter; it stays at its source offset"
            fields = {**fields, "value": None, "headers": [],
                      "last_error": f"{fields['last_error']}; {note}" if fields["last_error"] else note}
            headers = [*headers, (HEADER_PAYLOAD_DROPPED, str(size).encode())]

        def delivered(err: Any, _msg: Any) -> None:
            if err is not None and payload and err.code() in _TOO_LARGE:
                self._produce(topic, key, fields, headers, outcome, size, payload=False)
                return
            self._report(DeadLettered(*outcome, None if err is None else str(err)))

        try:
            self._producer.produce(topic, encode("dead_letter", fields), key=key, headers=headers,
                                   on_delivery=delivered)
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            if payload and isinstance(error, KafkaError) and error.code() in _TOO_LARGE:
                self._produce(topic, key, fields, headers, outcome, size, payload=False)
                return
            self._report(DeadLettered(*outcome, str(exc)))  # requeued and tried again, never fatal
            return
        except BufferError as exc:
            self._report(DeadLettered(*outcome, f"dead-letter queue full: {exc}"))
            return
        self._producer.poll(0)

    def poll(self) -> None:
        """Serve the producer's delivery reports."""
        if self._producer is not None:
            self._producer.poll(0)

    def refresh_parked(self) -> None:
        """Learn released (and newly parked) keys (park_key mode)."""
        policy = self._settings.dead_letter_policy
        if policy is None or policy.mode != "park_key":
            return
        try:
            self.parked = self._store.parked_keys(self._subscription)
        except redis.RedisError as exc:
            _LOGGER.warning("%s: reading parked keys failed: %s", self._subscription, exc)

    def close(self) -> None:
        """Wait up to 10 s for dead letters still in flight."""
        if self._producer is not None:
            self._producer.flush(10)
