"""What a moved key left in its old partitions (SUB-8): read from Kafka, by anyone.

A key held for a move waits until its old partitions can hold nothing of it published under an
earlier count: until each old partition's commit point in Kafka (the group's committed offset, the
lowest offset not settled there) has passed every such record of the key. Kafka's commit point is
durable: a record below it is never delivered again, whatever happens to Redis, so a moved key's
new messages never go out before an old one that could still come again (SUB-4 across partitions).
Acks alone are not enough: a Redis that lost them (a crash, a FLUSHALL) would have the old records
redelivered after the new ones.

``OldPartitions`` answers this without the old partitions' owners (which may be other processes,
dead, or none yet): it reads each partition from its commit point to its end with a consumer of its
own that never joins the group, once, then only what is appended, keeping the offsets of the keys
that moved away; a key waits while one of them is at or above the commit point.
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
from ordering_layer.state.store import partition_keys

_KAFKA_TIMEOUT = 10.0
_SCAN_BATCH = 1000
_SKIP_AT_LEAST = 5000  # records below the commit point a read jumps over rather than reading them


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
        self._reader: Consumer | None = None
        self._reads: dict[int, _Read] = {}
        self._assigned: set[int] = set()

    def _client(self) -> Consumer:
        return Consumer({
            **self._kafka, "group.id": self.subscription, "client.id": f"ordering-layer-moves-{uuid.uuid4().hex}",
            "enable.auto.commit": False, "enable.partition.eof": False,
            "logger": logging.getLogger("ordering_layer.kafka.moves")})

    def consumer(self) -> Consumer:
        """The consumer of queries (metadata, watermarks, committed offsets; never assigned: librdkafka's
        watermark query can hang on a consumer that is fetching), made on first use."""
        if self._consumer is None:
            self._consumer = self._client()
        return self._consumer

    def reader(self) -> Consumer:
        """The consumer that reads the old partitions (assigned to them while they are read)."""
        if self._reader is None:
            self._reader = self._client()
        return self._reader

    def close(self) -> None:
        """Close the consumers."""
        for consumer in (self._consumer, self._reader):
            if consumer is not None:
                consumer.close()

    def forget(self) -> None:
        """Drop everything read and the assignment (nothing is waited for any more)."""
        self._reads.clear()
        if self._assigned:
            self._assigned = set()
            self.reader().unassign()

    def refresh(self, partitions: set[int], history: History) -> None:
        """Bring what is known of ``partitions`` up to their ends and their commit points now (and
        forget the others).

        The reader stays assigned to them and reads only what was appended since its last call; a
        read that the subscribers outrun jumps to the commit point. A partition is read again from
        its commit point when it is new here, the history grew, its commit point went back (a seek)
        or its owner epoch changed.

        Raises:
            KafkaException: the partitions could not be read to their ends in time.
            redis.RedisError: Redis did not answer.
        """
        consumer = self.consumer()
        for partition in [p for p in self._reads if p not in partitions]:
            del self._reads[partition]
        restarted = False
        highs: dict[int, int] = {}
        parts = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        committed = {tp.partition: tp.offset for tp in consumer.committed(parts, timeout=_KAFKA_TIMEOUT)}
        for part in parts:
            partition = part.partition
            low, highs[partition] = consumer.get_watermark_offsets(part, timeout=_KAFKA_TIMEOUT)
            epoch = int(self._store.client.get(partition_keys(self.subscription, partition)[0]) or 0)
            start = max(committed[partition], low)
            read = self._reads.get(partition)
            if read is None or read.epoch != epoch or read.history != history or start < read.start:
                self._reads[partition] = _Read(epoch, history, start, start)
                restarted = True
            else:
                read.start = start
        reader = self.reader()
        if restarted or set(self._reads) != self._assigned:
            reader.assign([TopicPartition(self.topic, p, read.end) for p, read in self._reads.items()])
            self._assigned = set(self._reads)
        self._read(reader, highs)

    def unsettled(self, partition: int, keys: Mapping[bytes, int]) -> set[bytes]:
        """Those of ``keys`` with a record in ``partition`` (read up to its end by ``refresh``),
        published under a count below the one the key waits for (its value in ``keys``), at or
        above the partition's commit point in Kafka."""
        read = self._reads[partition]
        return {key for key in keys if read.head(key, keys[key]) is not None}

    def pending(self, partition: int) -> bool:
        """Whether a record read in ``partition`` of a key that moved away is at or above its commit point."""
        read = self._reads.get(partition)
        return read is None or any(read.head(key, 1 << 31) is not None for key in read.offsets)

    def _read(self, consumer: Consumer, highs: Mapping[int, int]) -> None:
        """Read the assigned partitions up to ``highs``, noting the offset and count of every record
        of a key that a later count routes elsewhere (only such a key can wait for these partitions)."""
        reads = self._reads
        behind = {p for p, read in reads.items() if read.end < highs[p]}
        deadline = time.monotonic() + 10 * _KAFKA_TIMEOUT
        while behind:
            if time.monotonic() > deadline:
                raise KafkaException(f"partitions {sorted(behind)} not read to their ends in time")
            # Most records are of keys that stay: they cost one key() and one dict look-up.
            for record in consumer.consume(_SCAN_BATCH, 0.2):
                key, partition = record.key(), record.partition()
                if key is None or partition not in reads:
                    continue
                read = reads[partition]
                moves = read.moving.get(key)
                if moves is None:
                    moves = read.moving[key] = any(partition_for(key, count) != partition
                                                   for count, _ in read.history[1:])
                offset = record.offset()
                if not moves or offset is None or offset >= highs[partition] or record.error() is not None:
                    continue
                headers = record.headers()
                published = read_metadata(headers).partition_count if headers else None  # type: ignore[arg-type]
                read.add(key, offset, count_at(read.history, published, record.timestamp()[1]))
            # The consumer's positions: past the records taken, transaction markers and compacted gaps.
            for at in consumer.position([TopicPartition(self.topic, p) for p in behind]):
                read = reads[at.partition]
                read.end = max(read.end, at.offset)
                # Below the commit point everything is settled for good: a read that the subscribers
                # drain faster than it goes jumps there instead of reading settled records.
                if read.start > read.end + _SKIP_AT_LEAST and read.start < highs[at.partition]:
                    try:
                        consumer.seek(TopicPartition(self.topic, at.partition, read.start))
                    except KafkaException:
                        continue
                    read.end = read.start
            behind = {p for p in behind if reads[p].end < highs[p]}


class _Read:
    """What was read of one old partition, from ``start`` (its commit point then) to ``end``: every
    key's record offsets and the counts they were published under, in offset order, and where the
    ones not known settled begin."""

    __slots__ = ("counts", "end", "epoch", "first", "history", "moving", "offsets", "start")

    def __init__(self, epoch: int, history: History, start: int, end: int) -> None:
        self.epoch, self.history, self.start, self.end = epoch, history, start, end
        self.offsets: dict[bytes, array[int]] = {}
        self.counts: dict[bytes, array[int]] = {}
        self.first: dict[bytes, int] = {}  # key -> index of its first offset at or above ``start``
        self.moving: dict[bytes, bool] = {}  # key -> a later count routes it elsewhere

    def add(self, key: bytes, offset: int, count: int) -> None:
        if key not in self.offsets:
            self.offsets[key], self.counts[key], self.first[key] = array("q"), array("q"), 0
        self.offsets[key].append(offset)
        self.counts[key].append(count)

    def head(self, key: bytes, below: int) -> int | None:
        """The key's first offset at or above the commit point published under a count below
        ``below``; None when there is none."""
        offsets = self.offsets.get(key)
        if offsets is None:
            return None
        counts, index = self.counts[key], self.first[key]
        while index < len(offsets) and offsets[index] < self.start:
            index += 1
        self.first[key] = index
        while index < len(offsets) and counts[index] >= below:
            index += 1
        return offsets[index] if index < len(offsets) else None
