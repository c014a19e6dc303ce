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

from ordering_layer._core import NativeFetch
from ordering_layer.kafka.partitioner import murmur2, partition_for
from ordering_layer.record import read_metadata
from ordering_layer.state import StateStore
from ordering_layer.state.counts import History
from ordering_layer.state.departed import Departed
from ordering_layer.state.store import FLOOR_MEMBER, partition_keys
from ordering_layer.subscriber.native_fetch import open_native_fetch

_LOGGER = logging.getLogger(__name__)

_KAFKA_TIMEOUT = 10.0
_SCAN_BATCH = 1000
_SKIP_AT_LEAST = 5000  # records below the floor a read jumps over rather than reading them
_ASK_ROUNDS = 64  # ZMSCORE round trips per old partition and check, at most
_NO_END = 1 << 62  # an end past any offset: every record the reader takes is looked at


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
        self._scan: NativeFetch | None = None  # the reader's records looked at without the GIL, when it can be
        self._native = True  # scan with a NativeFetch (until a read through one did not get to the end)
        self._history: History = []
        self._reads: dict[int, _Read] = {}
        self._assigned: set[int] = set()
        self._marked: dict[tuple[int, bytes], tuple[int, int]] = {}  # (partition, key) -> count, below

    def _client(self, client_id: str | None = None) -> Consumer:
        return Consumer({
            **self._kafka, "group.id": self.subscription,
            "client.id": client_id or f"ordering-layer-moves-{uuid.uuid4().hex}",
            "enable.auto.commit": False, "enable.partition.eof": False,
            "logger": logging.getLogger("ordering_layer.kafka.moves")})

    def consumer(self) -> Consumer:
        """The consumer of queries (metadata, watermarks, committed offsets; never assigned: librdkafka's
        watermark query can hang on a consumer that is fetching), made on first use."""
        if self._consumer is None:
            self._consumer = self._client()
        return self._consumer

    def reader(self) -> Consumer:
        """The consumer that reads the old partitions (assigned to them while they are read); its
        records are scanned by a ``NativeFetch`` when one can be opened on it (only the records of
        keys that move become Python objects), else read through ``consume()``."""
        if self._reader is None:
            client_id = f"ordering-layer-moves-{uuid.uuid4().hex}"
            self._reader = self._client(client_id)
            if self._native:
                self._scan = open_native_fetch(self._reader, {"client.id": client_id}, self.topic,
                                               lambda record: None)
        return self._reader

    def _assign(self, reader: Consumer, starts: list[TopicPartition]) -> None:
        scan = self._scan
        if scan is not None:
            scan.detach(scan.attached())
        reader.assign(starts)
        if scan is not None:
            scan.attach([part.partition for part in starts])

    def _renew(self) -> None:
        """A read did not get to the partitions' ends in time: the reader is made again, reading
        through ``consume()`` from then on, and everything is read again from the commit points."""
        _LOGGER.warning("%s: the old partitions' reader did not get to their ends in time; made again%s",
                        self.subscription, " (through consume())" if self._scan is not None else "")
        reader, scan = self._reader, self._scan
        self._reader, self._scan, self._native = None, None, False
        self._reads.clear()
        self._assigned = set()
        if scan is not None:
            scan.close()
        if reader is not None:
            reader.close()

    def close(self) -> None:
        """Close the consumers."""
        if self._scan is not None:
            self._scan.close()
        for consumer in (self._consumer, self._reader):
            if consumer is not None:
                consumer.close()

    def forget(self) -> None:
        """Drop everything read and the assignment (nothing is waited for any more)."""
        self._reads.clear()
        if self._assigned:
            self._assigned = set()
            self._assign(self.reader(), [])

    def refresh(self, partitions: set[int], history: History) -> None:
        """Bring what is known of ``partitions`` up to their ends now (and forget the others).

        The reader stays assigned to them and reads only what was appended since its last call.
        A partition is read again from its commit point (the group's committed offset, or the floor
        an owner wrote to Redis when higher) when it is new here, the history grew, or its owner
        epoch changed (a new owner, a seek, a Redis that lost its state: settled offsets may be
        unsettled again).

        Raises:
            KafkaException: the partitions could not be read to their ends in time.
            redis.RedisError: Redis did not answer.
        """
        consumer = self.consumer()
        self._history = history
        for partition in [p for p in self._reads if p not in partitions]:
            del self._reads[partition]
        restarted = False
        highs: dict[int, int] = {}
        for partition in sorted(partitions):
            part = TopicPartition(self.topic, partition)
            low, highs[partition] = consumer.get_watermark_offsets(part, timeout=_KAFKA_TIMEOUT)
            epoch, floor = int(self._store.client.get(partition_keys(self.subscription, partition)[0]) or 0), \
                self._floor(partition)
            read = self._reads.get(partition)
            if read is None or read.epoch != epoch or read.history != history:
                (committed,) = consumer.committed([part], timeout=_KAFKA_TIMEOUT)
                start = max(committed.offset if committed.offset >= 0 else low, low, floor)
                self._reads[partition] = _Read(epoch, history, start, start)
                restarted = True
            else:
                read.start = max(read.start, floor)
        reader = self.reader()
        if restarted or set(self._reads) != self._assigned:
            self._assign(reader, [TopicPartition(self.topic, p, read.end) for p, read in self._reads.items()])
            self._assigned = set(self._reads)
        try:
            self._read(reader, highs)
        except KafkaException:
            self._renew()
            raise

    def unsettled(self, partition: int, keys: Mapping[bytes, int]) -> set[bytes]:
        """Those of ``keys`` that have a record in ``partition`` (read up to its end by ``refresh``),
        published under a count below the one the key waits for (its value in ``keys``), that is
        not settled. Redis is asked about the first offset of each key not known settled (the key
        waits while it is unsettled; once settled, about the next one).

        Raises:
            redis.RedisError: Redis did not answer.
        """
        read = self._reads[partition]
        settled_key = partition_keys(self.subscription, partition)[1]
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

    def departures(self, cleared: Mapping[bytes, int], partition: int, history: History,
                   seek_generation: int) -> list[Departed]:
        """The marks that ``cleared`` keys (key -> the count they waited for in ``partition``) departed
        from their old partitions, up to where those were read (``refresh``); a mark written before
        (``marked``) that covers as much is left out."""
        marks = []
        for key, count in cleared.items():
            for old in old_partitions(key, partition, count, history):
                below = self._reads[old].end
                known = self._marked.get((old, key))
                if known is None or known[0] < count or known[1] < below:
                    marks.append(Departed(old, key, count, below, seek_generation))
        return marks

    def marked(self, marks: list[Departed]) -> None:
        """``marks`` were written."""
        for mark in marks:
            self._marked[(mark.partition, mark.key)] = (mark.count, mark.below)

    def pending(self, partition: int) -> bool:
        """Whether a record read in ``partition`` of a key that moved away is not known settled."""
        read = self._reads.get(partition)
        return read is None or any(read.head(key, 1 << 31) is not None for key in read.offsets)

    def _floor(self, partition: int) -> int:
        """The floor an owner of ``partition`` wrote to Redis (-1: none): every offset below it is settled."""
        raw = self._store.client.zscore(partition_keys(self.subscription, partition)[1], FLOOR_MEMBER)
        return int(raw) if raw is not None else -1

    def _read(self, consumer: Consumer, highs: Mapping[int, int]) -> None:
        """Read the assigned partitions up to ``highs`` at least, noting the offset and count of every
        record of a key that a later count routes elsewhere (only such a key can wait for these
        partitions). Every record taken is looked at, up to the reader's position, which is where
        the read ends: a record appended after ``highs`` were asked (the high watermark moved since:
        a follower caught up, or a producer still publishing under an earlier count) may be taken
        in the same fetch, and the read's end, the departure marks' bound, passes it."""
        reads = self._reads
        behind = {p for p, read in reads.items() if read.end < highs[p]}
        deadline = time.monotonic() + 3 * _KAFKA_TIMEOUT
        while behind:
            if time.monotonic() > deadline:
                raise KafkaException(f"partitions {sorted(behind)} not read to their ends in time")
            if self._scan is not None:
                ends = dict.fromkeys(reads, _NO_END)
                for number, where, moving_key, count in self._scan.scan_moving(_SCAN_BATCH, 0.2, self._history, ends):
                    reads[number].add(moving_key, where, count)
            # Most records are of keys that stay: they cost one key() and one dict look-up.
            for record in consumer.consume(_SCAN_BATCH, 0 if self._scan is not None else 0.2):
                key, partition = record.key(), record.partition()
                if key is None or partition not in reads:
                    continue
                read = reads[partition]
                moves = read.moving.get(key)
                if moves is None:
                    moves = read.moving[key] = any(partition_for(key, count) != partition
                                                   for count, _ in read.history[1:])
                offset = record.offset()
                if not moves or offset is None or record.error() is not None:
                    continue
                headers = record.headers()
                published = read_metadata(headers).partition_count if headers else None  # type: ignore[arg-type]
                read.add(key, offset, count_at(read.history, published, record.timestamp()[1]))
            # The consumer's positions: past the records taken, transaction markers and compacted gaps.
            for at in consumer.position([TopicPartition(self.topic, p) for p in behind]):
                read = reads[at.partition]
                read.end = max(read.end, at.offset)
                # Below the floor everything is settled: a read that the subscribers drain faster than
                # it goes jumps to the floor instead of reading settled records.
                floor = self._floor(at.partition)
                if floor > read.end + _SKIP_AT_LEAST and floor < highs[at.partition]:
                    try:
                        consumer.seek(TopicPartition(self.topic, at.partition, floor))
                    except KafkaException:
                        continue
                    read.end = read.start = max(read.start, floor)
            behind = {p for p in behind if reads[p].end < highs[p]}


class _Read:
    """What was read of one old partition, from ``start`` (its commit point then) to ``end``: every
    key's record offsets and the counts they were published under, in offset order, and where the
    ones not known settled begin."""

    __slots__ = ("counts", "done", "end", "epoch", "first", "history", "moving", "offsets", "start")

    def __init__(self, epoch: int, history: History, start: int, end: int) -> None:
        self.epoch, self.history, self.start, self.end = epoch, history, start, end
        self.offsets: dict[bytes, array[int]] = {}
        self.counts: dict[bytes, array[int]] = {}
        self.first: dict[bytes, int] = {}  # key -> index of its first offset not known settled
        self.done: dict[bytes, set[int]] = {}  # key -> offsets past ``first`` known settled
        self.moving: dict[bytes, bool] = {}  # key -> a later count routes it elsewhere

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
