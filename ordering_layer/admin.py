"""``Admin``: topics (and, with Redis, subscriptions, snapshots and seeks) of the layer.

Topics are created with ``message.timestamp.type=LogAppendTime`` so that every record carries the
broker's enqueued time.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewPartitions, NewTopic  # type: ignore[attr-defined]

from ordering_layer.auth import verify_kafka
from ordering_layer.config import (
    DEAD_LETTER_MAX_BYTES,
    DEFAULT_SNAPSHOT_TOPIC,
    DEFAULT_SNAPSHOT_TTL,
    DeadLetterPolicy,
    PushConfig,
    RetryPolicy,
    StartPosition,
    SubscriptionSettings,
    require_bootstrap,
)
from ordering_layer.deadletter import DeadLetter, list_dead_letters, redrive
from ordering_layer.describe import SubscriptionDescription, describe_subscription
from ordering_layer.errors import ConfigError, SubscriptionExistsError, TopicError, TopicExistsError
from ordering_layer.kafka_config import connection_settings
from ordering_layer.offsets import retrying
from ordering_layer.seek.runner import Progress, SeekResult, SeekRunner
from ordering_layer.seek.snapshots import Snapshot, SnapshotBook, check_name
from ordering_layer.seek.targets import snapshot_targets
from ordering_layer.state import StateStore
from ordering_layer.state.counts import PartitionCounts

_LOGGER = logging.getLogger(__name__)

_TIMEOUT = 30.0
_METADATA_SETTLE = 3.0  # seconds create_subscription asks again about a topic a broker does not know


@dataclass(frozen=True)
class TopicDescription:
    """A topic as the broker describes it."""

    name: str
    partitions: int
    replication_factor: int
    config: dict[str, str]
    partitions_with_leader: int = 0

    @property
    def timestamp_type(self) -> str:
        """``LogAppendTime`` for topics the layer created."""
        return self.config.get("message.timestamp.type", "")


class Admin:
    """Topic (and subscription) administration.

    Args:
        config: confluent-kafka settings; ``bootstrap.servers`` is required (with ``security.protocol``,
            ``sasl.*`` and ``ssl.*`` for a secured cluster); the admin's clients take only these
            ``connection_settings``, so a consumer's or producer's settings may be passed as they are.
        redis_url: the Redis holding subscription state (needed for subscriptions only); see
            ``ordering_layer.state.client`` for its forms (TLS, ACL user, Redis Cluster).
        snapshot_topic: the compacted topic that keeps the snapshots (GRP-3; created on first use).

    Raises:
        ConfigError: ``bootstrap.servers`` is missing or confluent-kafka refuses the config.
        AuthenticationError: Kafka refused the credentials or the TLS handshake (``server="kafka"``);
            Redis does so on first use of a subscription method (``server="redis"``).
    """

    def __init__(self, config: Mapping[str, Any], *, redis_url: str | None = None,
                 snapshot_topic: str = DEFAULT_SNAPSHOT_TOPIC) -> None:
        require_bootstrap(config)
        conf = connection_settings(config)
        verify_kafka(conf)
        conf.setdefault("logger", logging.getLogger("ordering_layer.kafka.admin"))
        try:
            self._admin = AdminClient(conf)
        except KafkaException as exc:
            raise ConfigError(f"Kafka admin config refused: {exc.args[0]}") from exc
        self._config = conf
        self.redis_url = redis_url
        self._store: StateStore | None = None
        self._counts: PartitionCounts | None = None
        self._snapshots = SnapshotBook(conf, snapshot_topic)

    @property
    def store(self) -> StateStore:
        """The Redis state store (needs ``redis_url``)."""
        if self._store is None:
            if not self.redis_url:
                raise ConfigError("subscriptions need Admin(..., redis_url=...)")
            self._store = StateStore(self.redis_url, kafka_config=self._config)
        return self._store

    # -- subscriptions -----------------------------------------------------------------------------
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
        described = self.describe_topic(topic, settle=_METADATA_SETTLE)
        if dead_letter_policy is not None:
            self.create_topic(dead_letter_policy.topic, partitions=described.partitions, exist_ok=True,
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

    def describe_subscription(self, name: str) -> SubscriptionDescription:
        """Settings, group state, and per partition: owner, epoch, committed offset, log end, backlog,
        outstanding messages, oldest unacked age, held and parked keys (``ordering_layer.describe``).

        Raises:
            SubscriptionNotFoundError: no such subscription.
            TopicError: Kafka did not answer.
        """
        try:
            return describe_subscription(self._admin, self._config, self.store, name, _TIMEOUT)
        except KafkaException as exc:
            raise TopicError(f"describing subscription {name!r} failed: {exc.args[0]}", topic=name) from exc

    # -- snapshots and seek (GRP-3) ------------------------------------------------------------------
    def _runner(self, subscription: str) -> SeekRunner:
        topic = self.store.settings(subscription).topic
        return SeekRunner(self._config, self._admin, self.store, subscription, topic, _TIMEOUT)

    def create_snapshot(self, name: str, subscription: str, *, ttl: float = DEFAULT_SNAPSHOT_TTL) -> Snapshot:
        """Take a snapshot of the subscription's acked state: per partition the committed offset and
        the offsets acked above it. It can be sought to until it expires, ``ttl`` seconds from now.

        Raises:
            ConfigError: a bad name or a ttl <= 0.
            SubscriptionNotFoundError: no such subscription.
            SnapshotExistsError: a snapshot of that name exists and has not expired.
            TopicError, PublishError: Kafka did not answer or did not store it.
        """
        check_name(name)
        if ttl <= 0:
            raise ConfigError(f"ttl must be > 0 seconds, got {ttl}")
        runner = self._runner(subscription)
        try:
            snapshot = runner.capture(name, ttl)
        finally:
            runner.close()
        self._snapshots.add(snapshot)
        _LOGGER.info("snapshot %s of %s taken (%d partitions, %d acked above the committed offsets)", name,
                     subscription, len(snapshot.partitions), snapshot.settled_above)
        return snapshot

    def get_snapshot(self, name: str) -> Snapshot:
        """The snapshot ``name``. Raises ``SnapshotNotFoundError`` (also once it has expired)."""
        return self._snapshots.get(name)

    def list_snapshots(self) -> list[Snapshot]:
        """The snapshots that have not expired, by name (expired ones are deleted as they are seen)."""
        return self._snapshots.list()

    def delete_snapshot(self, name: str) -> None:
        """Delete a snapshot. Raises ``SnapshotNotFoundError`` when there is none of that name."""
        self._snapshots.delete(name)

    def seek(self, subscription: str, *, time: datetime | None = None, snapshot: str | None = None,
             timeout: float = 60.0, progress: Progress | None = None) -> SeekResult:
        """Seek the subscription to a time or a snapshot (GRP-3), for all of its subscribers.

        To ``time``: messages published before it count as acked, the others as unacked (a time in
        the past replays acked messages; a time past the last message purges the backlog). To
        ``snapshot``: the acked state the snapshot holds is restored (messages published after it
        count as unacked). Running subscribers apply it within seconds without restarting: acks
        of deliveries made before the seek are ignored afterwards, each ordering key is delivered
        again from its first unacked message, in order, with delivery attempts restarting at 1.
        Without subscribers (an empty group) it is applied here.

        Args:
            subscription: the subscription.
            time: a timezone-aware time.
            snapshot: the name of a snapshot of a subscription of the same topic.
            timeout: seconds to wait until every partition has applied it.
            progress: called with (partitions applied, partitions) as that changes.

        Raises:
            ConfigError: neither or both of ``time`` and ``snapshot``; a naive time; a snapshot of
                another topic.
            SubscriptionNotFoundError, SnapshotNotFoundError: no such subscription or snapshot.
            SeekTimeoutError: partitions had not applied it within ``timeout`` (it stays pending
                and is applied when their owners next look, or when they are next claimed).
        """
        if (time is None) == (snapshot is None):
            raise ConfigError("seek needs exactly one of time= and snapshot=")
        if time is not None and time.tzinfo is None:
            raise ConfigError("seek needs a timezone-aware time (e.g. datetime.now(UTC))")
        runner = self._runner(subscription)
        try:
            positions = runner.positions()
            if time is not None:
                targets = runner.time_targets(int(time.timestamp() * 1000), positions)
            else:
                assert snapshot is not None
                kept = self._snapshots.get(snapshot)
                if kept.topic != runner.topic:
                    raise ConfigError(f"snapshot {snapshot!r} is of topic {kept.topic!r}, subscription "
                                      f"{subscription!r} of {runner.topic!r}")
                targets = snapshot_targets(kept, {row.partition: row.low for row in positions})
            return runner.run(targets, positions, timeout, progress)
        finally:
            runner.close()

    def _dead_letter_topic(self, subscription: str) -> str:
        policy = self.store.settings(subscription).dead_letter_policy
        if policy is None:
            raise ConfigError(f"subscription {subscription!r} has no dead-letter policy")
        return policy.topic

    def list_dead_letters(self, subscription: str) -> list[DeadLetter]:
        """The subscription's dead letters, in dead-letter order (DLQ-5)."""
        return list_dead_letters(self._config, self._dead_letter_topic(subscription))

    def redrive_dead_letters(self, subscription: str, *, topic: str | None = None) -> list[DeadLetter]:
        """Republish the dead letters not redriven yet to their source topic (or ``topic``), per key in
        their original order; return what was republished (DLQ-5)."""
        return redrive(self._config, subscription, self._dead_letter_topic(subscription), topic)

    def release_key(self, subscription: str, ordering_key: str | bytes) -> bool:
        """Release a key parked by a ``park_key`` policy; its next messages are delivered again."""
        return self.store.release_key(subscription, ordering_key)

    def delete_subscription(self, name: str) -> None:
        """Delete the subscription's settings (tombstoning their durable copy) and state, and its
        consumer group.

        Raises:
            SubscriptionNotFoundError: no such subscription.
            PublishError, TopicError: the durable copy could not be tombstoned (nothing was deleted).
        """
        self.store.settings(name)
        self.store.delete_subscription(name)
        futures = self._admin.delete_consumer_groups([name], request_timeout=_TIMEOUT)
        try:
            futures[name].result(timeout=_TIMEOUT)
        except KafkaException as exc:
            _LOGGER.info("deleting consumer group %s: %s", name, exc)

    def _broker_count(self) -> int:
        return max(1, len(self._admin.list_topics(timeout=_TIMEOUT).brokers))

    def create_topic(self, name: str, partitions: int = 1, *, replication_factor: int | None = None,
                     config: Mapping[str, str] | None = None, exist_ok: bool = False) -> TopicDescription:
        """Create a topic with broker append time; return its description.

        Args:
            name: topic name.
            partitions: partition count (>= 1).
            replication_factor: defaults to min(3, brokers in the cluster).
            config: further topic settings (``message.timestamp.type`` is always LogAppendTime;
                with 3 or more replicas ``min.insync.replicas`` defaults to 2, so an acked publish
                is on two brokers and one broker can fail without stopping writes).
            exist_ok: return the existing topic instead of raising.

        Raises:
            TopicExistsError: it exists and ``exist_ok`` is false.
            TopicError: the broker refused it.
        """
        if partitions < 1:
            raise ConfigError(f"partitions must be >= 1, got {partitions}")
        settings = {**(config or {}), "message.timestamp.type": "LogAppendTime"}
        replication = replication_factor or min(3, self._broker_count())
        if replication >= 3:
            settings.setdefault("min.insync.replicas", "2")
        futures = self._admin.create_topics(
            [NewTopic(name, num_partitions=partitions, replication_factor=replication, config=settings)],
            operation_timeout=_TIMEOUT, request_timeout=_TIMEOUT)
        try:
            futures[name].result(timeout=_TIMEOUT)
        except KafkaException as exc:
            error = exc.args[0]
            if isinstance(error, KafkaError) and error.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                if exist_ok:
                    # Created by a concurrent caller: the broker answering may not show it yet.
                    return self._await_topic(name)
                raise TopicExistsError(f"topic {name!r} exists already", topic=name) from exc
            raise TopicError(f"creating topic {name!r} failed: {error}", topic=name) from exc
        return self._await_topic(name, partitions)

    def _await_topic(self, name: str, partitions: int | None = None) -> TopicDescription:
        """The topic's description once metadata shows ``partitions`` partitions (default: as many as
        it has, at least one), each with a leader; creation is asynchronous."""
        deadline = time.monotonic() + _TIMEOUT
        while True:
            try:
                described = self.describe_topic(name)
                wanted = max(1, described.partitions) if partitions is None else partitions
                if described.partitions >= wanted and described.partitions_with_leader >= wanted:
                    return described
            except TopicError:
                if time.monotonic() > deadline:
                    raise
            if time.monotonic() > deadline:
                return described
            time.sleep(0.05)

    def describe_topic(self, name: str, *, settle: float = 0.0) -> TopicDescription:
        """Partitions, replication and the non-default config of a topic.

        Args:
            name: the topic.
            settle: seconds to ask again while the broker asked does not know the topic (in a
                cluster, a topic created moments ago may be unknown for a moment to some brokers).

        Raises:
            TopicError: the topic does not exist (after ``settle``) or cannot be read.
        """
        settle_until = time.monotonic() + settle
        while True:
            metadata = self._admin.list_topics(name, timeout=_TIMEOUT)
            topic = metadata.topics.get(name)
            if topic is not None and topic.error is None:
                break
            if time.monotonic() >= settle_until:
                reason = topic.error.str() if topic is not None and topic.error else "unknown topic"
                raise TopicError(f"topic {name!r}: {reason}", topic=name)
            time.sleep(0.1)
        resource = ConfigResource(ConfigResource.Type.TOPIC, name)
        try:
            entries = self._admin.describe_configs([resource])[resource].result(timeout=_TIMEOUT)
        except KafkaException as exc:
            raise TopicError(f"describing topic {name!r} failed: {exc.args[0]}", topic=name) from exc
        config = {key: str(entry.value) for key, entry in entries.items() if entry.value is not None}
        replication = len(next(iter(topic.partitions.values())).replicas) if topic.partitions else 0
        led = sum(1 for p in topic.partitions.values() if p.leader >= 0 and p.error is None)
        return TopicDescription(name, len(topic.partitions), replication, config, led)

    def add_partitions(self, name: str, total: int) -> TopicDescription:
        """Raise a topic's partition count to ``total``. Most keys move to another partition; with a
        Redis (``redis_url``) the growth is recorded in the topic's partition-count history first, so
        that running subscribers hold each moved key's new records until its old ones are settled
        (SUB-8). Subscribers notice a growth made without it too, a few seconds later.

        Raises:
            TopicError: the broker refused (for example ``total`` is not above the current count).
        """
        if self.redis_url:
            self.record_partition_count(name, self.describe_topic(name).partitions)
        growing = int(time.time() * 1000)
        futures = self._admin.create_partitions([NewPartitions(name, total)],
                                                operation_timeout=_TIMEOUT, request_timeout=_TIMEOUT)
        try:
            futures[name].result(timeout=_TIMEOUT)
        except KafkaException as exc:
            raise TopicError(f"adding partitions to {name!r} failed: {exc.args[0]}", topic=name) from exc
        if self.redis_url:
            self.record_partition_count(name, total, since_ms=growing)
        return self._await_topic(name, total)

    def partition_counts(self, name: str) -> list[tuple[int, int]]:
        """The topic's partition-count history (SUB-8): ascending (count, in force from, ms since
        the epoch; the first from 0); empty when none was recorded. Needs ``redis_url``."""
        return self.counts.history(name)

    def record_partition_count(self, name: str, count: int, *, since_ms: int | None = None) -> list[tuple[int, int]]:
        """Record that topic ``name`` has ``count`` partitions (from ``since_ms``, default now; a
        count known already keeps its time); returns the history. Needs ``redis_url``."""
        return self.counts.record(name, count, int(time.time() * 1000) if since_ms is None else since_ms)

    @property
    def counts(self) -> PartitionCounts:
        """The partition-count histories of topics (``state.counts``; needs ``redis_url``)."""
        if self._counts is None:
            self._counts = PartitionCounts(self.store.client, self._config)
        return self._counts

    def delete_topic(self, name: str) -> None:
        """Delete a topic (ignores a topic that does not exist)."""
        futures = self._admin.delete_topics([name], operation_timeout=_TIMEOUT, request_timeout=_TIMEOUT)
        try:
            futures[name].result(timeout=_TIMEOUT)
        except KafkaException as exc:
            error = exc.args[0]
            if isinstance(error, KafkaError) and error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                return
            raise TopicError(f"deleting topic {name!r} failed: {error}", topic=name) from exc
