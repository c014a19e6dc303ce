"""``Admin``: topics (and, with Redis, subscriptions, snapshots and seeks) of the layer.

Topics are created with ``message.timestamp.type=LogAppendTime`` so that every record carries the
broker's enqueued time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from confluent_kafka import KafkaException

from ordering_layer.config import DEFAULT_SNAPSHOT_TOPIC, DEFAULT_SNAPSHOT_TTL, require_bootstrap
from ordering_layer.deadletter import DeadLetter, list_dead_letters, redrive
from ordering_layer.describe import SubscriptionDescription, describe_subscription
from ordering_layer.errors import ConfigError, TopicError
from ordering_layer.kafka.auth import verify_kafka
from ordering_layer.kafka.topics import TopicDescription
from ordering_layer.kafka_config import connection_settings
from ordering_layer.seek.runner import Progress, SeekResult, SeekRunner
from ordering_layer.seek.snapshots import Snapshot, SnapshotBook, check_name
from ordering_layer.seek.targets import snapshot_targets
from ordering_layer.subscriptions import Subscriptions

__all__ = ["Admin", "TopicDescription"]

_LOGGER = logging.getLogger(__name__)

_TIMEOUT = 30.0


class Admin(Subscriptions):
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
        super().__init__(conf, redis_url=redis_url)
        self._snapshots = SnapshotBook(conf, snapshot_topic)

    # -- subscriptions (created by ``Subscriptions.create_subscription``) -------------------------------
    def describe_subscription(self, name: str) -> SubscriptionDescription:
        """Settings, group state, and per partition: owner, epoch, committed offset, log end, backlog,
        outstanding messages, oldest unacked age, held and parked keys (``ordering_layer.describe``).

        Raises:
            SubscriptionNotFoundError: no such subscription.
            TopicError: Kafka did not answer.
        """
        try:
            return describe_subscription(self.topics.client, self._config, self.store, name, _TIMEOUT)
        except KafkaException as exc:
            raise TopicError(f"describing subscription {name!r} failed: {exc.args[0]}", topic=name) from exc

    # -- snapshots and seek (GRP-3) ------------------------------------------------------------------
    def _runner(self, subscription: str) -> SeekRunner:
        topic = self.store.settings(subscription).topic
        return SeekRunner(self._config, self.topics.client, self.store, subscription, topic, _TIMEOUT)

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
        futures = self.topics.client.delete_consumer_groups([name], request_timeout=_TIMEOUT)
        try:
            futures[name].result(timeout=_TIMEOUT)
        except KafkaException as exc:
            _LOGGER.info("deleting consumer group %s: %s", name, exc)

    # -- topics (``kafka.topics``) ---------------------------------------------------------------------
    def create_topic(self, name: str, partitions: int = 1, *, replication_factor: int | None = None,
                     config: Mapping[str, str] | None = None, exist_ok: bool = False) -> TopicDescription:
        """Create a topic with broker append time; return its description (``Topics.create``: the
        replication defaults to min(3, brokers), with ``min.insync.replicas=2`` from 3 replicas).

        Raises:
            TopicExistsError: it exists and ``exist_ok`` is false.
            TopicError: the broker refused it.
        """
        return self.topics.create(name, partitions, replication_factor=replication_factor, config=config,
                                  exist_ok=exist_ok)

    def describe_topic(self, name: str, *, settle: float = 0.0) -> TopicDescription:
        """Partitions, replication and the non-default config of a topic; ``settle``: seconds to ask
        again while the broker asked does not know the topic.

        Raises:
            TopicError: the topic does not exist (after ``settle``) or cannot be read.
        """
        return self.topics.describe(name, settle=settle)

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
        self.topics.add_partitions(name, total)
        if self.redis_url:
            self.record_partition_count(name, total, since_ms=growing)
        return self.topics.wait_for(name, total)

    def delete_topic(self, name: str) -> None:
        """Delete a topic (ignores a topic that does not exist)."""
        self.topics.delete(name)
