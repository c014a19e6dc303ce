"""Kafka commits of the partitions' commit points (ACK-4) and seeks at a running engine (GRP-3).

Once a commit interval the coordinator takes the commit points that moved (``offsets``) for the
fetch thread to commit; the commit reports come back as ``Committed`` requests (``committed``): only
then may Redis forget what is settled below them. Commits carry the partition's seek generation, so
that a report of a commit made before a seek is told apart from one made after it, which completes
the seek.

Seeks are noticed with the commits, once an interval (one Redis read, ``look_for_seek``): the owned
partitions with a pending seek are claimed again and restarted at its target (``Partitions.
apply_seeks``), their outstanding deliveries are void (a later ack of one is refused: its epoch is
gone), and the consumer seeks go to the fetcher (``take_seeks``). Used by the coordinator on its
thread, under its lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis
from confluent_kafka import TopicPartition

from ordering_layer.subscriber.partitions import Partitions
from ordering_layer.subscriber.requests import Committed, SeekPartition

_LOGGER = logging.getLogger(__name__)

COMMIT_INTERVAL = 1.0  # seconds between asynchronous commits (and looks for a seek)


class Commits:
    """The commit interval, commit reports and seek look-ups of one engine.

    Args:
        owned: the owned partitions (commit points, seek generations, claims for a seek).
        topic: the subscribed topic.
        subscription: subscription name (for logs).
    """

    def __init__(self, owned: Partitions, topic: str, subscription: str) -> None:
        self._owned = owned
        self._topic = topic
        self._subscription = subscription
        self.last = 0.0  # monotonic time the commit points were last taken
        self._seek_seen: int | None = None  # the seek generation announced when last looked

    def due(self, now: float) -> bool:
        """The commit interval has passed since the commit points were last taken."""
        return now - self.last >= COMMIT_INTERVAL

    def offsets(self, *, sync: bool, only: list[int] | None = None) -> list[TopicPartition]:
        """The commit points to commit (see ``Partitions.commit_offsets``); starts a new interval."""
        self.last = time.monotonic()
        return self._owned.commit_offsets(self._topic, sync=sync, only=only)

    def committed(self, event: Committed, now: float) -> None:
        """Commits the group coordinator took: a commit after a seek (GRP-3) of the partition
        completes the seek. (Redis forgets what is settled below the commit point with each flush,
        ``OpKind.FLOOR``, whether or not it is committed in Kafka yet.)"""
        owned = self._owned
        for partition, _, seek_generation in event.offsets:
            if seek_generation is not None:
                owned.confirm(partition, seek_generation)
        for partition in event.failed:
            owned.commit_failed(partition)

    def look_for_seek(self, flush: Callable[[], bool]) -> tuple[list[int], list[int]]:
        """Apply a newly announced seek (GRP-3) to the owned partitions, without a restart: what was
        decided before is written first (``flush``: it happened before the seek), then each partition
        with the seek pending is claimed again and restarted at its target.

        Returns the partitions restarted (their queued ops and outstanding deliveries are void) and
        those fenced (another owner has them); both empty when no new seek was announced, or when
        Redis failed (the look is made again at the next interval).
        """
        try:
            announced = self._owned.seek_announced()
            if announced == self._seek_seen or not flush():
                return [], []
            restarted, fenced = self._owned.apply_seeks()
        except redis.RedisError as exc:
            _LOGGER.warning("%s: looking for seeks failed (%s); retrying", self._subscription, exc)
            return [], []
        self._seek_seen = announced
        if restarted:
            self.last = 0.0  # commit the targets at the next step: that completes the seek
        return restarted, fenced

    def take_seeks(self) -> list[SeekPartition]:
        """The consumer seeks queued by claims and restarts, for the fetcher (each taken once)."""
        seeks = self._owned.seeks
        if not seeks:
            return []
        taken = list(seeks)
        seeks.clear()
        return taken
