"""The fetch side of the engine: owns the Kafka consumer and the one thread that calls it.

librdkafka's consumer is not safe for concurrent calls from Python threads, so only the fetch thread
calls it while it runs: ``consume`` (which also serves the rebalance callbacks and commit reports),
pause and resume as the flow-control gate says (SUB-7; through ``consume()`` only), and commits and
seeks (GRP-3), which reach it only as queued requests. Each fetched batch carries every partition's
assignment generation, bumped on each assignment, revocation, loss and seek, so that records
fetched for an ownership (or a position) that has ended are never taken by a later one (SUB-3).
Records are read once here (``fetched``): metadata, size, timestamp (PUB-7, DLQ-4). Where it can,
the fetcher takes them natively (``native_fetch``: the assigned partitions' queues are attached
after an assignment and detached before a revocation or loss, on this thread); ``consume()`` then
serves only the consumer's events.
"""

from __future__ import annotations

import functools
import logging
import queue
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from ordering_layer.kafka.offsets import tagged_generation
from ordering_layer.subscriber.fetched import to_record
from ordering_layer.subscriber.flow import FlowGate, Gate
from ordering_layer.subscriber.native_fetch import open_native_fetch
from ordering_layer.subscriber.records import Record
from ordering_layer.subscriber.requests import Committed, Fetched, SeekPartition, Sought
from ordering_layer.worker import Worker

_LOGGER = logging.getLogger(__name__)

_FETCH_BATCH = 500
_PAUSED_POLL = 0.005
_AMPLE_POLL = 0.05  # how long the fetch waits at most, while records are ample, between serving events
_MALFORMED_LOGGED = 10  # malformed-metadata warnings logged one by one; then every 1000th

RebalanceCallback = Callable[[list[TopicPartition]], None]


class RebalanceHooks(NamedTuple):
    """User code told of partitions assigned, revoked (before they are let go) and lost."""

    on_assign: RebalanceCallback | None = None
    on_revoke: RebalanceCallback | None = None
    on_lost: RebalanceCallback | None = None


class Ownership(Protocol):
    """What the fetcher tells the coordinator about partition ownership (on the fetch thread)."""

    def assigned(self, partitions: list[int], generations: Mapping[int, int]) -> Mapping[int, int]:
        """Claim newly assigned partitions (before their first fetch); returns the offsets to start
        at where a claim applied a seek (the others start at the committed offset)."""

    def revoking(self, partitions: list[int]) -> list[TopicPartition]:
        """Let revoked partitions go; returns the offsets to commit before they move."""

    def lost(self, partitions: list[int]) -> None:
        """Drop lost partitions (another owner has them already)."""


def _tell(callback: RebalanceCallback | None, partitions: list[TopicPartition], what: str) -> None:
    if callback is None:
        return
    try:
        callback(partitions)
    except Exception:
        _LOGGER.exception("%s callback failed", what)


def payload_bytes(records: list[Record]) -> int:
    """The payload bytes of ``records``, estimated from at most 16 of them spread over the batch."""
    step = max(1, len(records) // 16)
    sample = records[::step]
    return sum(len(record.value or b"") for record in sample) * len(records) // len(sample)


class Fetcher:
    """The Kafka consumer of one engine and its fetch thread.

    Args:
        config: the consumer's full confluent-kafka settings.
        subscription: subscription name (for logs and the thread name).
        topic: the subscribed topic.
        gate: the flow-control gate, read before each fetch.
        ownership: the coordinator's side of rebalances.
        post: receives ``Fetched`` batches and ``Committed`` and ``Sought`` reports.
        rebalance: user callbacks, told after a claim and before a revoke lets go.
        native: fetch with ``NativeFetch`` where it can be used (``native_fetch``); False always
            fetches through ``consume()``.
    """

    def __init__(self, config: Mapping[str, Any], subscription: str, topic: str, gate: FlowGate,
                 ownership: Ownership, post: Callable[[Any], None], rebalance: RebalanceHooks, *,
                 native: bool = True) -> None:
        self.subscription = subscription
        self.topic = topic
        self._gate = gate
        self._ownership = ownership
        self._post = post
        self._rebalance = rebalance
        self._user_on_commit = config.get("on_commit")
        self.consumer = Consumer({**config, "on_commit": self._on_commit})
        self._requests: queue.SimpleQueue[list[TopicPartition] | SeekPartition] = queue.SimpleQueue()
        self._seeks: dict[int, SeekPartition] = {}  # seeks the consumer could not do yet, by partition
        self.generations: dict[int, int] = {}  # fetch thread: bumped on each assign, revoke, loss
        self.paused = False  # the assignment is paused in the consumer (through consume() only)
        # The assignment, kept from the rebalance callbacks: the consumer's ``assignment()`` asks
        # librdkafka's main thread and waits for its answer with the GIL held.
        self._assigned: set[int] = set()
        self.malformed_records = 0  # records whose ol- metadata was ignored (DLQ-4)
        self.highest_count = 0  # the highest ol-partition-count fetched (a growth, SUB-8)
        self.native = open_native_fetch(self.consumer, dict(config), topic, self._malformed_metadata,
                                        self._counted) if native else None
        if self.native is not None:
            gate.on_room = self.native.waker().wake
        self._worker = Worker(f"ordering-layer-fetch-{subscription}", self.step)

    def start(self) -> None:
        """Join the group and start fetching."""
        self.consumer.subscribe([self.topic], on_assign=self._on_assign, on_revoke=self._on_revoke,
                                on_lost=self._on_lost)
        self._worker.start()

    def stop(self) -> None:
        """Stop the fetch thread (the consumer stays open for a last synchronous commit)."""
        self._worker.stop()

    def close(self) -> None:
        """Leave the group and close the consumer (after ``stop``)."""
        if self.native is not None:
            self.native.close()
        try:
            self.consumer.close()
        except (KafkaException, RuntimeError) as exc:
            _LOGGER.warning("closing consumer of %s: %s", self.subscription, exc)

    def commit(self, offsets: list[TopicPartition]) -> None:
        """Queue an asynchronous commit for the fetch thread (any thread)."""
        self._requests.put(offsets)

    def seek(self, request: SeekPartition) -> None:
        """Queue a seek of the consumer for the fetch thread (any thread); ``Sought`` reports it done."""
        self._requests.put(request)

    def commit_sync(self, offsets: list[TopicPartition]) -> bool:
        """Commit now: on the fetch thread, or after ``stop``. False when the commit failed. A commit
        made is reported (``Committed``) as the asynchronous ones are."""
        if not offsets:
            return True
        try:
            committed = self.consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            _LOGGER.warning("%s: commit failed: %s", self.subscription, exc)
            return False
        self._on_commit(None, committed or offsets)
        return True

    def step(self) -> float:
        """One turn of the fetch thread: queued commits and seeks, the gate, one ``consume``."""
        requests = self._requests
        while not requests.empty():
            request = requests.get_nowait()
            if isinstance(request, SeekPartition):
                self._seeks[request.partition] = request
                continue
            try:
                self.consumer.commit(offsets=request, asynchronous=True)
            except KafkaException as exc:
                _LOGGER.warning("%s: commit failed: %s", self.subscription, exc)
        if self._seeks:
            self._seek_partitions()
        gate, native = self._gate, self.native
        state = gate.fetch_state(time.monotonic())
        # SUB-2 across partitions: while the gate is not OPEN or records are ample, the partitions
        # short of records still take up to their share (``FlowGate.short``, the native fetch only).
        short = gate.short if native is not None and (state is not Gate.OPEN or gate.ample) else None
        if (state is Gate.HELD and not short) or not gate.room_to_fetch():
            # SUB-7: no records taken while over the limit or not yet taken; the gate wakes this
            # thread when it opens (or the coordinator took the records), so that releases do not
            # run out of fetched records while it sleeps.
            gate.wait_for_room(_PAUSED_POLL)
            return 0.0
        if native is None:
            self._pause_as(state is Gate.PAUSED)
        # With the native fetch the consumer's queue carries events only (served here: rebalance
        # callbacks, commit reports); a record it still returns was queued before its partition was
        # attached, and is taken as one fetched by consume().
        messages = self.consumer.consume(_FETCH_BATCH, 0)
        if not messages and native is None:
            # consume() waits until its batch is full or the time is up: wait for one record only,
            # then take what came with it (a batch is what is there, never held back to fill).
            messages = self.consumer.consume(1, _PAUSED_POLL if self.paused else 0.1)
            if messages:
                messages += self.consumer.consume(_FETCH_BATCH - 1, 0)
        records: list[Record] = []
        for msg in messages:
            if msg.error() is not None:
                _LOGGER.warning("fetch error on %s: %s", self.subscription, msg.error())
                continue
            record = to_record(msg)
            if record.metadata.malformed is not None:
                self._malformed_metadata(record)
            self._counted(record.metadata.partition_count or 0)
            records.append(record)
        # A full batch from consume() may have more of its partitions' records behind it: the native
        # queue, whose records of those partitions are newer, waits for the next turn. While enough
        # records are ready (``ample``), or the gate is PAUSED, the partitions' queues are left to
        # librdkafka's prefetch (bounded by queued.max.messages.kbytes), but for the short ones, and
        # this thread waits for the gate, serving the consumer's events meanwhile. The assignment is
        # never paused in the consumer: librdkafka's pause() waits for its broker thread with the
        # GIL held, and throws the prefetch away.
        if native is not None and len(messages) < _FETCH_BATCH:
            if not short and (state is Gate.PAUSED or (gate.ample and state is Gate.OPEN)):
                if not records:
                    gate.wait_for_room(_PAUSED_POLL if state is Gate.PAUSED else _AMPLE_POLL)
            else:
                fetched, errors = native.fetch(_FETCH_BATCH, 0.1 if not records else 0, short)
                records.extend(fetched)
                for partition, offset, error in errors:
                    _LOGGER.warning("fetch error on %s: partition %d offset %d: %s", self.subscription, partition,
                                    offset, error)
        if records:
            gate.posted(len(records), payload_bytes(records))
            self._post(self.fetched(records))
        return 0.0

    def fetched(self, records: list[Record]) -> Fetched:
        """Fetch thread: tag records just fetched with the assignment generations."""
        return Fetched(records, dict(self.generations), self.highest_count)

    def _counted(self, count: int) -> None:
        self.highest_count = max(self.highest_count, count)

    def _malformed_metadata(self, record: Record) -> None:
        """DLQ-4: malformed ``ol-`` headers are ignored; the record is delivered as a plain record."""
        self.malformed_records += 1
        count = self.malformed_records
        if count <= _MALFORMED_LOGGED or count % 1000 == 0:
            _LOGGER.warning("%s: record %d:%d has malformed layer metadata (%s), ignored; delivered as a plain "
                            "record (%d such records so far)", self.subscription, record.partition,
                            record.offset, record.metadata.malformed, count)

    def _seek_partitions(self) -> None:
        """Seek the consumer where asked (GRP-3). A partition assigned just now cannot be sought until
        its fetch has started: it is tried again at the next turn. Records of the partition fetched
        from here on get a new generation (those fetched before belong to the state of before)."""
        for partition, request in list(self._seeks.items()):
            if partition not in self._assigned:
                del self._seeks[partition]  # revoked or lost since: the next owner applies the seek at claim
                continue
            try:
                self.consumer.seek(TopicPartition(self.topic, partition, request.offset))
            except KafkaException as exc:
                error = exc.args[0]
                if not isinstance(error, KafkaError) or error.code() != KafkaError._STATE:
                    _LOGGER.warning("%s: seek of partition %d failed (%s); retrying", self.subscription, partition,
                                    exc)
                continue
            del self._seeks[partition]
            self.generations[partition] = self.generations.get(partition, 0) + 1
            self._post(Sought(partition, self.generations[partition], request.seek_generation))

    def _next_generation(self, partitions: list[TopicPartition]) -> None:
        generations = self.generations
        for tp in partitions:
            generations[tp.partition] = generations.get(tp.partition, 0) + 1
            self._seeks.pop(tp.partition, None)  # made for an ownership that ends here

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._next_generation(partitions)
        starts = self._ownership.assigned([tp.partition for tp in partitions], self.generations)
        for tp in partitions:
            if tp.partition in starts:
                tp.offset = starts[tp.partition]  # a claim applied a seek (GRP-3)
        # Assigned here rather than by the client after this callback, so that the new partitions
        # join the gate's state before their first fetch: through consume(), paused while the
        # assignment is paused (SUB-7), and resumed otherwise, as librdkafka may keep a pause from
        # an earlier ownership of the partition, which no later resume of the then assignment reached.
        consumer.incremental_assign(partitions)
        self._assigned.update(tp.partition for tp in partitions)
        if self.native is not None:
            self.native.attach([tp.partition for tp in partitions])
        else:
            self._pause(partitions, self.paused)
        _tell(self._rebalance.on_assign, partitions, "on_assign")

    def _detach(self, partitions: list[TopicPartition]) -> None:
        self._assigned.difference_update(tp.partition for tp in partitions)
        if self.native is not None:
            self.native.detach([tp.partition for tp in partitions])

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._detach(partitions)
        self._next_generation(partitions)
        _tell(self._rebalance.on_revoke, partitions, "on_revoke")
        self.commit_sync(self._ownership.revoking([tp.partition for tp in partitions]))

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._detach(partitions)
        self._next_generation(partitions)
        self._ownership.lost([tp.partition for tp in partitions])
        _tell(self._rebalance.on_lost, partitions, "on_lost")

    def _on_commit(self, err: Any, partitions: list[TopicPartition]) -> None:
        """A commit reached the group coordinator: only now may Redis forget what lies below it. A
        refused commit (a rebalance, a coordinator loading) is reported so that it is sent again;
        the program's own ``on_commit`` is told, as confluent-kafka tells it."""
        mine = [tp for tp in partitions if tp.topic == self.topic]
        if err is not None:
            failed = tuple(tp.partition for tp in mine)
            done = []
        else:
            failed = tuple(tp.partition for tp in mine if tp.error is not None)
            done = [(tp.partition, tp.offset, tagged_generation(tp.metadata)) for tp in mine
                    if tp.error is None and tp.offset >= 0]
        if done or failed:
            self._post(Committed(done, failed))
        _tell(self._user_on_commit and functools.partial(self._user_on_commit, err), partitions, "on_commit")

    def _pause_as(self, paused: bool) -> None:
        """Through consume(): pause the assignment in the consumer while the gate is PAUSED; resume
        it when the gate opens."""
        if paused != self.paused:
            self._pause([TopicPartition(self.topic, partition) for partition in sorted(self._assigned)], paused)
            self.paused = paused

    def _pause(self, partitions: list[TopicPartition], pause: bool) -> None:
        if partitions:
            try:
                (self.consumer.pause if pause else self.consumer.resume)(partitions)
            except KafkaException as exc:
                _LOGGER.warning("%s: %s failed: %s", self.subscription, "pause" if pause else "resume", exc)
