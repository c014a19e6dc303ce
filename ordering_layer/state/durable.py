"""The durable copy of subscription settings, in a compacted Kafka topic (``schemas/subscription.avsc``).

Redis holds the working copy of a subscription's settings; losing Redis (a FLUSHALL, a new empty
server) must not lose the subscription, so its settings are also a record in the compacted topic
``SUBSCRIPTIONS_TOPIC``, keyed by the subscription name. Deleting the subscription writes a
tombstone, so a deleted subscription is never read back.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

from ordering_layer.config import SUBSCRIPTIONS_TOPIC, DeadLetterPolicy, PushConfig, RetryPolicy, SubscriptionSettings
from ordering_layer.errors import RecordFormatError
from ordering_layer.kafka.compacted import CompactedTopic
from ordering_layer.record import decode, encode

_LOGGER = logging.getLogger(__name__)

SCHEMA = "subscription"
# The layout before push_config: records written by earlier releases of the layer.
SCHEMA_V1 = "subscription_v1"


def encode_settings(name: str, settings: SubscriptionSettings) -> bytes:
    """The ``Subscription`` record of ``name`` with ``settings``, as schemaless Avro."""
    return encode(SCHEMA, {"name": name, **dataclasses.asdict(settings), "created_at_ms": int(time.time() * 1000)})


def decode_settings(payload: bytes) -> tuple[str, SubscriptionSettings]:
    """The subscription name and settings of a ``Subscription`` record (of this layout, or of the one
    before ``push_config``, ``subscription_v1``).

    Raises:
        RecordFormatError: ``payload`` is not a ``Subscription`` record.
    """
    try:
        raw = decode(SCHEMA, payload)
    except RecordFormatError:
        raw = decode(SCHEMA, payload, written_with=SCHEMA_V1)
    policy, push = raw["dead_letter_policy"], raw["push_config"]
    return raw["name"], SubscriptionSettings(
        topic=raw["topic"], enable_message_ordering=raw["enable_message_ordering"],
        ack_deadline=raw["ack_deadline"], retry_policy=RetryPolicy(**raw["retry_policy"]),
        dead_letter_policy=DeadLetterPolicy(**policy) if policy is not None else None,
        max_lease_duration=raw["max_lease_duration"],
        min_duration_per_lease_extension=raw["min_duration_per_lease_extension"],
        max_duration_per_lease_extension=raw["max_duration_per_lease_extension"],
        push_config=PushConfig(**push) if push is not None else None)


class SettingsLog:
    """Writes and reads the durable copy of subscription settings.

    Args:
        kafka_config: confluent-kafka settings of the layer's cluster (``bootstrap.servers``; the
            ``security.protocol``, ``sasl.*`` and ``ssl.*`` of a secured cluster pass through).
        topic: the compacted topic, created on first write.
    """

    def __init__(self, kafka_config: Mapping[str, Any], topic: str = SUBSCRIPTIONS_TOPIC) -> None:
        self._topic = CompactedTopic(kafka_config, topic, "subscriptions")
        self.topic = topic

    def __repr__(self) -> str:
        return f"SettingsLog({self.topic})"

    def write(self, name: str, settings: SubscriptionSettings) -> None:
        """Store the settings of ``name``; durable on return.

        Raises:
            PublishError: the broker did not acknowledge the record.
            TopicError: the topic cannot be created.
        """
        self._topic.send([(name, encode_settings(name, settings))])

    def forget(self, name: str) -> None:
        """Record that ``name`` was deleted (a tombstone). Raises like ``write``."""
        self._topic.send([(name, None)])

    def read(self, name: str) -> SubscriptionSettings | None:
        """The settings of ``name`` last written, or None (never written, or deleted).

        Raises:
            TopicError: the topic cannot be read.
        """
        value = self._topic.read_all().get(name)
        if value is None:
            return None
        try:
            recorded, settings = decode_settings(value)
        except RecordFormatError:
            _LOGGER.warning("subscriptions topic %s: record of %r is not a Subscription record", self.topic, name)
            return None
        if recorded != name:
            _LOGGER.warning("subscriptions topic %s: record keyed %r names %r", self.topic, name, recorded)
            return None
        return settings

    def close(self) -> None:
        """Flush what is in flight."""
        self._topic.close()
