"""``Subscriptions``: create subscriptions and record the partition counts of their topics.

A subscription is a consumer group of the same name: its settings live in Redis with a durable
copy in a compacted topic, and its start position (GRP-1) is committed for the group at once.
``Admin`` offers this to users; ``OrderedConsumer`` creates the subscription it subscribes to with
it, without the admin facade.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from ordering_layer.config import (
    DEAD_LETTER_MAX_BYTES,
    DeadLetterPolicy,
    PushConfig,
    RetryPolicy,
    StartPosition,
    SubscriptionSettings,
)
from ordering_layer.errors import ConfigError, SubscriptionExistsError
from ordering_layer.kafka.offsets import retrying
from ordering_layer.kafka.topics import Topics
from ordering_layer.kafka_config import connection_settings
from ordering_layer.state import StateStore
from ordering_layer.state.counts import PartitionCounts

_TIMEOUT = 30.0
METADATA_SETTLE = 3.0  # seconds create_subscription asks again about a topic a broker does not know


class Subscriptions:
    """Subscription creation and topics' partition-count histories.

    Args:
        config: confluent-kafka settings (``bootstrap.servers`` at least); only their
            ``connection_settings`` are used.
        redis_url: the Redis holding subscription state (see ``ordering_layer.state.client``).
        topics: the topic calls to use (made from ``config`` otherwise).

    Raises:
        ConfigError: confluent-kafka refuses the config.
    """

    def __init__(self, config: Mapping[str, Any], *, redis_url: str | None = None,
                 topics: Topics | None = None) -> None:
        self._config = connection_settings(config)
        self.topics = topics or Topics(self._config)
        self.redis_url = redis_url
        self._store: StateStore | None = None
        self._counts: PartitionCounts | None = None

    @property
    def store(self) -> StateStore:
        """The Redis state store (needs ``redis_url``)."""
        if self._store is None:
            if not self.redis_url:
                raise ConfigError("subscriptions need Admin(..., redis_url=...)")
            self._store = StateStore(self.redis_url, kafka_config=self._config)
        return self._store

    @property
    def counts(self) -> PartitionCounts:
        """The partition-count histories of topics (``state.counts``; needs ``redis_url``)."""
        if self._counts is None:
            self._counts = PartitionCounts(self.store.client, self._config)
        return self._counts

    def create_subscription(self, name: str, *, topic: str, enable_message_ordering: bool = True,
                            ack_deadline: float = 10.0, retry_policy: RetryPolicy | None = None,
                            dead_letter_policy: DeadLetterPolicy | None = None,
                            start: StartPosition = StartPosition.TRIM_HORIZON,
                            max_lease_duration: float = 3600.0, min_duration_per_lease_extension: float = 0.0,
                            max_duration_per_lease_extension: float = 0.0,
                            push_config: PushConfig | None = None) -> SubscriptionSettings:
        """Create a durable subscription of ``topic`` (a consumer group of the same name).

        Settings are validated (ConfigError) and stored in Redis, with a durable copy in Kafka that a
        subscriber reads back when Redis lost them; ordering is fixed from now on. With
        ``push_config`` it is a push subscription: ``ordering-layer push`` (``ordering_layer.push``)
        POSTs its messages to the endpoint (PSH-1..3).
        The start position (GRP-1) is resolved to offsets and committed for the group at once, so
        every subscriber resumes from committed state. Creating it again with equal settings is a
        no-op; with other settings it raises ``SubscriptionExistsError``.
        """
        settings = SubscriptionSettings(
            topic=topic, enable_message_ordering=enable_message_ordering, ack_deadline=ack_deadline,
            retry_policy=retry_policy or RetryPolicy(), dead_letter_policy=dead_letter_policy,
            max_lease_duration=max_lease_duration,
            min_duration_per_lease_extension=min_duration_per_lease_extension,
            max_duration_per_lease_extension=max_duration_per_lease_extension, push_config=push_config)
        # The topic may have been created just before, through another broker of the cluster.
        described = self.topics.describe(topic, settle=METADATA_SETTLE)
        if dead_letter_policy is not None:
            self.topics.create(dead_letter_policy.topic, partitions=described.partitions, exist_ok=True,
                               config={"max.message.bytes": str(DEAD_LETTER_MAX_BYTES)})
        if not self.store.create_subscription(name, settings):
            if self.store.settings(name) == settings:
                # A subscription created by a store without a Kafka config has no durable copy yet.
                self.store.write_durable_copy(name, settings)
                return settings
            raise SubscriptionExistsError(name)
        self._commit_start(name, topic, described.partitions, start)
        self.record_partition_count(topic, described.partitions)
        return settings

    def _commit_start(self, group: str, topic: str, partitions: int, start: StartPosition) -> None:
        consumer = Consumer({**self._config, "group.id": group, "enable.auto.commit": False})
        try:
            offsets = []
            for partition in range(partitions):
                low, high = retrying(functools.partial(
                    consumer.get_watermark_offsets, TopicPartition(topic, partition), timeout=_TIMEOUT))
                offset = low if start.kind == "TRIM_HORIZON" else high
                if start.timestamp_ms is not None:
                    found = retrying(functools.partial(
                        consumer.offsets_for_times, [TopicPartition(topic, partition, start.timestamp_ms)],
                        timeout=_TIMEOUT))[0]
                    offset = found.offset if found.offset >= 0 else high
                offsets.append(TopicPartition(topic, partition, offset))
            retrying(lambda: consumer.commit(offsets=offsets, asynchronous=False))
        finally:
            consumer.close()

    def partition_counts(self, name: str) -> list[tuple[int, int]]:
        """The topic's partition-count history (SUB-8): ascending (count, in force from, ms since
        the epoch; the first from 0); empty when none was recorded. Needs ``redis_url``."""
        return self.counts.history(name)

    def record_partition_count(self, name: str, count: int, *, since_ms: int | None = None) -> list[tuple[int, int]]:
        """Record that topic ``name`` has ``count`` partitions (from ``since_ms``, default now; a
        count known already keeps its time); returns the history. Needs ``redis_url``."""
        return self.counts.record(name, count, int(time.time() * 1000) if since_ms is None else since_ms)
