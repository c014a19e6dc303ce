"""What a moved key left in its old partitions (SUB-8): read from Kafka and Redis, by anyone.

A key held for a move waits until every record of it published under an earlier count in its old
partitions is settled. ``OldPartitions`` answers that for a set of keys without the old partitions'
owners (which may be other processes, dead, or none yet): it reads a partition from its commit
point (the group's committed offset, or the floor an owner wrote to Redis when higher) to its end
with a consumer of its own that never joins the group, once, then only what is appended, and looks
the keys' records up in the partition's settled set in Redis. A Redis that lost its state makes
records look unsettled: keys then wait for their redeliveries, never less.
"""

from __future__ import annotations

import logging
import time
import uuid
from array import array
from collections.abc import Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from ordering_layer.publisher.partitioner import murmur2, partition_for
from ordering_layer.record import read_metadata
from ordering_layer.state import StateStore
from ordering_layer.state.counts import History
from ordering_layer.state.store import FLOOR_MEMBER, partition_keys

_KAFKA_TIMEOUT = 10.0
_SCAN_BATCH = 1000
_ASK_ROUNDS = 64  # ZMSCORE round trips per old partition and check, at most


def count_at(history: History, published: int | None, timestamp_ms: int) -> int:
    """The count a record was published under: its header, else the count in force at its append time."""
    if published:
        return published
    in_force = [count for count, since in history if since <= timestamp_ms]
    return in_force[-1] if in_force else history[0][0]


def old_partitions(key: bytes, partition: int, count: int, history: History) -> set[int]:
    """The partitions other than ``partition`` where ``key`` lived under the counts before ``count``."""
    hashed = murmur2(key) & 0x7FFFFFFF
    return {hashed % earlier for earlier, _ in history if earlier < count} - {partition}


class OldPartitions:
    """Reads old partitions of one subscription's topic for unsettled records of given keys.

    Args:
        kafka_config: connection settings of the cluster (the reader's consumer takes them).
        store: the Redis state store (settled sets and floors).
        subscription: the subscription (its group's committed offsets are read, never committed).
        topic: the subscription's topic.
    """

    def __init__(self, kafka_config: Mapping[str, Any], store: StateStore, subscription: str, topic: str) -> None:
        self._kafka = kafka_config
        self._store = store
        self.subscription = subscription
        self.topic = topic
        self._consumer: Consumer | None = None
        self._reads: dict[int, _Read] = {}

    def consumer(self) -> Consumer:
        """The reader's consumer (made on first use); also serves metadata queries."""
        if self._consumer is None:
            self._consumer = Consumer({
                **self._kafka, "group.id": self.subscription, "client.id": f"ordering-layer-moves-{uuid.uuid4().hex}",
                "enable.auto.commit": False, "enable.partition.eof": False,
                "logger": logging.getLogger("ordering_layer.kafka.moves")})
        return self._consumer

    def close(self) -> None:
        """Close the consumer."""
        if self._consumer is not None:
            self._consumer.close()

    def unsettled(self, partition: int, keys: Mapping[bytes, int], history: History) -> set[bytes]:
        """Those of ``keys`` that have a record in ``partition``, published under a count below the
        one the key waits for (its value in ``keys``), that is not settled.

        What was read stays known (``_Read``: every key's offsets from the commit point on): a later
        call reads only the records appended since, and asks Redis about the first offset of each
        key not known settled (the key waits while it is unsettled; once settled, the next one).
        The partition is read again from its commit point when the history grew, the commit point
        went back, or the partition's owner epoch changed (a new owner, a seek, a Redis that lost
        its state: settled offsets may be unsettled again).

        Raises:
            KafkaException: the partition could not be read to its end in time.
            redis.RedisError: Redis did not answer.
        """
        consumer = self.consumer()
        part = TopicPartition(self.topic, partition)
        low, high = consumer.get_watermark_offsets(part, timeout=_KAFKA_TIMEOUT)
        (committed,) = consumer.committed([part], timeout=_KAFKA_TIMEOUT)
        epoch_key, settled_key = partition_keys(self.subscription, partition)[:2]
        epoch_raw, floor_raw = self._store.client.get(epoch_key), self._store.client.zscore(settled_key, FLOOR_MEMBER)
        start = max(committed.offset if committed.offset >= 0 else low, low,
                    int(floor_raw) if floor_raw is not None else -1)
        epoch = int(epoch_raw or 0)
        read = self._reads.get(partition)
        if read is None or read.epoch != epoch or read.history != history or start < read.start:
            read = self._reads[partition] = _Read(epoch, history, start, start)
        if read.end < high:
            self._read(consumer, part, read, high)
        read.start = start
        waiting: set[bytes] = set()
        for _ in range(_ASK_ROUNDS):
            heads = {key: head for key in keys if key not in waiting
                     and (head := read.head(key, keys[key])) is not None}
            if not heads:
                break
            scores = self._store.client.execute_command(
                "ZMSCORE", settled_key, *(str(offset) for offset in heads.values()))
            for (key, offset), score in zip(heads.items(), scores, strict=True):
                if score is None:
                    waiting.add(key)
                else:
                    read.settled(key, offset)
        return waiting | {key for key in keys if key not in waiting and read.head(key, keys[key]) is not None}

    def forget(self) -> None:
        """Drop what was read (nothing is waited for any more)."""
        self._reads.clear()

    def _read(self, consumer: Consumer, part: TopicPartition, read: _Read, high: int) -> None:
        """Read ``part`` from ``read.end`` to ``high``, noting the offset and count of every record
        of a key that a later count routes elsewhere (only such a key can wait for this partition)."""
        later, here = [count for count, _ in read.history[1:]], part.partition
        consumer.assign([TopicPartition(part.topic, part.partition, read.end)])
        try:
            deadline = time.monotonic() + 10 * _KAFKA_TIMEOUT
            position = read.end
            while position < high:
                if time.monotonic() > deadline:
                    raise KafkaException(f"partition {part.partition} not read to offset {high} in time")
                for record in consumer.consume(_SCAN_BATCH, 1.0):
                    offset, key = record.offset(), record.key()
                    if record.error() is not None or offset is None:
                        continue
                    position = max(position, offset + 1)
                    if key is None or offset >= high or all(partition_for(key, c) == here for c in later):
                        continue
                    headers = record.headers()
                    published = read_metadata(headers).partition_count if headers else None  # type: ignore[arg-type]
                    read.add(key, offset, count_at(read.history, published, record.timestamp()[1]))
                # Past transaction markers and compacted gaps the consumer's position leads the records.
                (at,) = consumer.position([part])
                position = max(position, at.offset)
        finally:
            consumer.unassign()
        read.end = high


class _Read:
    """What was read of one old partition, from ``start`` (its commit point then) to ``end``: every
    key's record offsets and the counts they were published under, in offset order, and where the
    ones not known settled begin."""

    __slots__ = ("counts", "done", "end", "epoch", "first", "history", "offsets", "start")

    def __init__(self, epoch: int, history: History, start: int, end: int) -> None:
        self.epoch, self.history, self.start, self.end = epoch, history, start, end
        self.offsets: dict[bytes, array[int]] = {}
        self.counts: dict[bytes, array[int]] = {}
        self.first: dict[bytes, int] = {}  # key -> index of its first offset not known settled
        self.done: dict[bytes, set[int]] = {}  # key -> offsets past ``first`` known settled

    def add(self, key: bytes, offset: int, count: int) -> None:
        if key not in self.offsets:
            self.offsets[key], self.counts[key], self.first[key] = array("q"), array("q"), 0
        self.offsets[key].append(offset)
        self.counts[key].append(count)

    def head(self, key: bytes, below: int) -> int | None:
        """The key's first offset, published under a count below ``below``, not known settled (an
        offset below the commit point is settled); None when there is none."""
        offsets = self.offsets.get(key)
        if offsets is None:
            return None
        counts, index, done = self.counts[key], self.first[key], self.done.get(key, ())
        while index < len(offsets) and (offsets[index] < self.start or offsets[index] in done):
            index += 1
        self.first[key] = index
        while index < len(offsets) and (counts[index] >= below or offsets[index] in done):
            index += 1
        return offsets[index] if index < len(offsets) else None

    def settled(self, key: bytes, offset: int) -> None:
        """Redis says ``offset``, one of the key's offsets, is settled."""
        self.done.setdefault(key, set()).add(offset)
