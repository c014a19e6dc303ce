"""A topic's partition-count history (SUB-8): each count it had, and from when.

Kafka routes a key by ``murmur2(key) % count``; when partitions are added, most keys move to another
partition, and the order of a key's records across its old and new partitions is defined by the
count each was published under (PUB-6). The history is what subscribers need to tell a moved key
from one that stayed: ascending counts, each with the time (ms since the epoch) from which it was in
force; the first count's time is 0.

Whoever sees a count first records it (``Admin.create_topic``, ``create_subscription`` and
``add_partitions``, ``ordering-layer topic expand``, or a running subscriber whose metadata or
records show more partitions): in Redis, a hash per topic (``counts_key``) written with HSETNX so
that the first to record a count sets its time, and in a durable copy, a record per topic in the
compacted topic ``COUNTS_TOPIC``, so that losing Redis loses no history.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import redis

from ordering_layer.errors import OrderingLayerError
from ordering_layer.kafka.compacted import CompactedTopic

_LOGGER = logging.getLogger(__name__)

COUNTS_TOPIC = "__ordering_layer_partition_counts"

History = list[tuple[int, int]]  # ascending (count, in force from, ms since the epoch)


def counts_key(topic: str) -> str:
    """The Redis hash of a topic's counts: count -> the time (ms) from which it was in force."""
    return f"ol:counts:{{{topic}}}"


def moves_key(subscription: str) -> str:
    """The Redis hash of a subscription's keys held for a move (SUB-8): partition -> keys held, as
    its owner last reported them (expires unless refreshed)."""
    return f"ol:moves:{{{subscription}}}"


def report_held(client: Any, subscription: str, before: Mapping[int, int], holding: Mapping[int, int],
                expire_s: int) -> None:
    """Write the keys each partition holds for a move now (``holding``) over what was written
    ``before``, in ``moves_key``, expiring in ``expire_s`` seconds unless written again.

    Raises:
        redis.RedisError: Redis did not answer.
    """
    key = moves_key(subscription)
    pipe = client.pipeline(transaction=False)
    gone = [str(p) for p, n in before.items() if n and not holding.get(p)]
    if gone:
        pipe.hdel(key, *gone)
    now: dict[str | bytes, int] = {str(p): n for p, n in holding.items() if n}
    if now:
        pipe.hset(key, mapping=now)
        pipe.expire(key, expire_s)
    pipe.execute()


def encode_history(history: History) -> bytes:
    """The durable copy's record value."""
    return json.dumps([[count, since] for count, since in history]).encode()


def decode_history(value: bytes) -> History:
    """A durable copy's record value; empty when it is not a history (logged)."""
    try:
        raw = json.loads(value)
        return normalised([(int(count), int(since)) for count, since in raw])
    except (ValueError, TypeError):
        _LOGGER.warning("%s: a record that is not a partition-count history was ignored", COUNTS_TOPIC)
        return []


def normalised(history: list[tuple[int, int]]) -> History:
    """Ascending counts, each once (its earliest time), the first from time 0."""
    earliest: dict[int, int] = {}
    for count, since in history:
        if count > 0:
            earliest[count] = min(since, earliest.get(count, since))
    ordered = sorted(earliest.items())
    return [(count, 0 if index == 0 else since) for index, (count, since) in enumerate(ordered)]


class PartitionCounts:
    """Reads and records the partition-count histories of topics.

    Args:
        client: the layer's Redis client (a server or a cluster: one hash per topic).
        kafka_config: confluent-kafka settings of the layer's cluster, for the durable copy; None: Redis only.
    """

    def __init__(self, client: Any, kafka_config: Mapping[str, Any] | None) -> None:
        self._client = client
        self._durable = CompactedTopic(kafka_config, COUNTS_TOPIC, "partition-counts") \
            if kafka_config is not None else None

    def history(self, topic: str) -> History:
        """The topic's history; when Redis has none, the durable copy's, written back to Redis.

        Raises:
            redis.RedisError: Redis did not answer.
            TopicError: Redis had none and the durable copy could not be read.
        """
        stored = self.stored(topic)
        if stored:
            return stored
        if self._durable is None:
            return []
        value = self._durable.read_all().get(topic)
        kept = decode_history(value) if value is not None else []
        if kept:
            _LOGGER.warning("partition counts of %s missing in Redis: restored from their durable copy", topic)
            self._client.hset(counts_key(topic), mapping={str(count): since for count, since in kept})
        return kept

    def stored(self, topic: str) -> History:
        """The topic's history in Redis (empty when Redis has none; the durable copy is not read).

        Raises:
            redis.RedisError: Redis did not answer.
        """
        stored = self._client.hgetall(counts_key(topic))
        return normalised([(int(count), int(since)) for count, since in stored.items()])

    def last_count(self, topic: str) -> int | None:
        """The topic's latest partition count in Redis; None when Redis has none or did not answer."""
        try:
            stored = self.stored(topic)
        except redis.RedisError:
            return None
        return stored[-1][0] if stored else None

    def record(self, topic: str, count: int, since_ms: int) -> History:
        """Record that ``topic`` has ``count`` partitions from ``since_ms`` on (a count recorded
        before keeps its time; the first count of a history counts from 0), durably; the history after.

        Raises:
            redis.RedisError: Redis did not answer.
            PublishError, TopicError: the durable copy could not be written.
        """
        before = self.history(topic)
        if any(known == count for known, _ in before):
            return before
        since = since_ms if before else 0
        self._client.hsetnx(counts_key(topic), str(count), since)
        after = self.history(topic)
        if self._durable is not None:
            self._durable.send([(topic, encode_history(after))])
        _LOGGER.info("%s has %d partitions from %d ms on (history %s)", topic, count, since, after)
        return after

    def forget(self, topic: str) -> None:
        """Drop a deleted topic's history (Redis and the durable copy)."""
        self._client.delete(counts_key(topic))
        if self._durable is not None:
            try:
                self._durable.send([(topic, None)])
            except OrderingLayerError as exc:
                _LOGGER.warning("forgetting the partition counts of %s: %s", topic, exc)

    def close(self) -> None:
        """Flush the durable copy's writes in flight."""
        if self._durable is not None:
            self._durable.close()
