"""Taking snapshots and running seeks of one subscription (GRP-3), against Kafka and Redis.

A seek is recorded in Redis per partition (target offset, settled offsets above it) under a new
seek generation, which is then announced. The owner of each partition notices the announcement and
applies it without restarting (``ordering_layer.subscriber``): it claims the partition again (a new
epoch fences every ack and write of before the seek), seeks its consumer, restarts the partition's
state from the target, commits the target and marks the generation applied. A partition claimed
later applies a pending seek at claim. When the group has no members, nobody would: the admin
commits the targets itself (Kafka refuses that commit while the group has members, so it can never
overtake a subscriber) and resets the Redis state. ``SeekRunner.run`` waits until every partition
has marked the generation applied.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from ordering_layer.errors import SeekTimeoutError, TopicError
from ordering_layer.kafka.offsets import PartitionOffsets, partition_offsets, seek_tag
from ordering_layer.kafka_config import connection_settings
from ordering_layer.record import now_ms
from ordering_layer.seek.snapshots import Snapshot
from ordering_layer.seek.targets import SeekTarget, snapshot_state, time_targets
from ordering_layer.state import StateStore

_LOGGER = logging.getLogger(__name__)

_POLL = 0.1  # seconds between looks at the partitions' progress
_GROUP_CHECK = 1.0  # seconds between checks whether the group is empty (then the admin applies)

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class PartitionSeek:
    """How a seek moved one partition: from the ``previous`` committed offset (None: never
    committed) to ``target``, with ``settled`` offsets above it counting as acked."""

    partition: int
    previous: int | None
    target: int
    settled: int
    by_admin: bool


@dataclass(frozen=True)
class SeekResult:
    """A seek applied by every partition of the subscription."""

    subscription: str
    generation: int
    partitions: tuple[PartitionSeek, ...]

    @property
    def applied_by_subscribers(self) -> int:
        """Partitions whose owner applied the seek while running (or at claim)."""
        return sum(1 for p in self.partitions if not p.by_admin)

    @property
    def applied_by_admin(self) -> int:
        """Partitions of an empty group, applied by the admin."""
        return sum(1 for p in self.partitions if p.by_admin)

    @property
    def rewound(self) -> int:
        """Offsets moved back over (their messages are delivered again unless settled)."""
        return sum(max(0, (p.previous or 0) - p.target) for p in self.partitions)

    @property
    def skipped(self) -> int:
        """Offsets moved forward over (their messages count as acked: a purged backlog)."""
        return sum(max(0, p.target - (p.previous or 0)) for p in self.partitions if p.previous is not None)


class SeekRunner:
    """Snapshots and seeks of one subscription.

    Args:
        kafka_config: confluent-kafka settings.
        admin: the Kafka admin client (group descriptions).
        store: the Redis state store.
        subscription: the subscription (its consumer group).
        topic: the subscription's topic.
        timeout: seconds allowed for each Kafka request.
    """

    def __init__(self, kafka_config: Mapping[str, Any], admin: AdminClient, store: StateStore, subscription: str,
                 topic: str, timeout: float) -> None:
        self._admin = admin
        self._store = store
        self.subscription = subscription
        self.topic = topic
        self._timeout = timeout
        # Never subscribes: it reads the group's offsets, and commits them only while the group is
        # empty (the broker refuses a commit of a non-member otherwise).
        self._consumer = Consumer({"logger": logging.getLogger("ordering_layer.kafka.seek"),
                                   **connection_settings(kafka_config), "group.id": subscription,
                                   "enable.auto.commit": False})

    def close(self) -> None:
        """Close the consumer."""
        self._consumer.close()

    def positions(self) -> list[PartitionOffsets]:
        """Committed offset and log bounds of every partition of the topic.

        Raises:
            TopicError: the topic is gone or Kafka did not answer.
        """
        try:
            metadata = self._consumer.list_topics(self.topic, timeout=self._timeout).topics.get(self.topic)
            if metadata is None or metadata.error is not None:
                raise TopicError(f"topic {self.topic!r} of {self.subscription!r} cannot be read", topic=self.topic)
            return partition_offsets(self._consumer, self.topic, sorted(metadata.partitions), self._timeout)
        except KafkaException as exc:
            raise TopicError(f"reading offsets of {self.subscription!r}: {exc.args[0]}", topic=self.topic) from exc

    def capture(self, name: str, ttl: float) -> Snapshot:
        """The subscription's acked state now, as snapshot ``name`` expiring in ``ttl`` seconds.

        The committed offsets are read before the settled sets, and a partition's acked state starts
        at its floor in Redis when that is above its committed offset (``StateStore.settled_from``):
        a commit or a flush in between can only leave out of the snapshot acks it could have held (a
        later seek delivers them again), never count an unacked message as acked.
        """
        committed = {row.partition: row.committed if row.committed is not None else row.low
                     for row in self.positions()}
        acked = self._store.settled_from(self.subscription, committed)
        created = now_ms()
        return Snapshot(name, self.subscription, self.topic, created, created + int(ttl * 1000),
                        snapshot_state({p: start for p, (start, _) in acked.items()},
                                       {p: settled for p, (_, settled) in acked.items()}))

    def time_targets(self, when_ms: int, positions: Sequence[PartitionOffsets]) -> list[SeekTarget]:
        """Targets of a seek to ``when_ms`` (ms since the epoch)."""
        asked = [TopicPartition(self.topic, row.partition, when_ms) for row in positions]
        try:
            found = self._consumer.offsets_for_times(asked, timeout=self._timeout)
        except KafkaException as exc:
            raise TopicError(f"finding offsets of {self.topic!r} by time: {exc.args[0]}", topic=self.topic) from exc
        return time_targets({tp.partition: tp.offset for tp in found}, {row.partition: row.end for row in positions})

    def run(self, targets: Sequence[SeekTarget], positions: Sequence[PartitionOffsets], timeout: float,
            progress: Progress | None = None) -> SeekResult:
        """Record and announce the seek, then wait until every partition has applied it.

        Args:
            targets: one per partition of the topic.
            positions: the committed offsets before the seek (for the result).
            timeout: seconds to wait for the partitions.
            progress: called with (partitions applied, partitions) whenever the first changes.

        Raises:
            SeekTimeoutError: partitions had not applied it after ``timeout`` (it stays pending).
        """
        by_partition = {t.partition: t for t in targets}
        partitions = sorted(by_partition)
        generation = self._store.post_seek(self.subscription, {t.partition: (t.offset, t.settled) for t in targets})
        _LOGGER.info("%s: seek %d recorded for %d partitions", self.subscription, generation, len(partitions))
        by_admin: set[int] = set()
        deadline = time.monotonic() + timeout
        next_group_check = time.monotonic()
        shown = -1
        while True:
            status = self._store.seek_status(self.subscription, partitions)
            waiting = [p for p in partitions if status[p].applied < generation]
            if progress is not None and len(partitions) - len(waiting) != shown:
                shown = len(partitions) - len(waiting)
                progress(shown, len(partitions))
            if not waiting:
                break
            now = time.monotonic()
            if now >= next_group_check:
                next_group_check = now + _GROUP_CHECK
                mine = [by_partition[p] for p in waiting if status[p].generation == generation]
                applied = self._apply_if_empty(generation, mine)
                if applied:
                    by_admin |= applied
                    continue
            if now > deadline:
                raise SeekTimeoutError(self.subscription, generation, tuple(waiting), timeout)
            time.sleep(_POLL)
        previous = {row.partition: row.committed for row in positions}
        return SeekResult(self.subscription, generation, tuple(
            PartitionSeek(p, previous.get(p), by_partition[p].offset, len(by_partition[p].settled), p in by_admin)
            for p in partitions))

    def _group_empty(self) -> bool:
        try:
            group = self._admin.describe_consumer_groups(
                [self.subscription], request_timeout=self._timeout)[self.subscription].result(timeout=self._timeout)
        except KafkaException as exc:
            _LOGGER.debug("describing group %s: %s", self.subscription, exc.args[0])
            return True  # the commit below decides: the broker refuses it for a group with members
        return not group.members

    def _apply_if_empty(self, generation: int, targets: Sequence[SeekTarget]) -> set[int]:
        """Apply the seek to ``targets`` when the group has no members; return the partitions applied.

        The owner epochs are read before the commit: a subscriber that joins after the commit
        claims the partition (a new epoch) and applies the seek itself, and the re-claim below,
        made only under the epochs read, then leaves that partition alone.
        """
        if not targets or not self._group_empty():
            return set()
        epochs = self._store.epochs(self.subscription, [t.partition for t in targets])
        offsets = [TopicPartition(self.topic, t.partition, t.offset, metadata=seek_tag(generation)) for t in targets]
        try:
            self._consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            _LOGGER.info("%s: group has members now (%s); they apply seek %d", self.subscription, exc.args[0],
                         generation)
            return set()
        claimed = self._store.claim_for_seek(self.subscription, epochs, mark_applied=True, generation=generation)
        applied = {p for p, state in claimed.items() if state is not None}
        _LOGGER.info("%s: seek %d applied by the admin to partitions %s (empty group)", self.subscription,
                     generation, sorted(applied))
        return applied
