"""Order across a partition expansion (SUB-8): the topic's count history, and the keys it moved.

After a topic grows, a key's records under the new count land in its new partition q while those it
got before sit in its old partition p, possibly at another subscriber. The compiled core holds a
moved key's queue in q (``PartitionCore.set_moves``); this guard gives the cores the history, and
clears a held key once every record of it published under an earlier count in each of its old
partitions is settled (acked or dead-lettered), whoever owns those partitions, or none does.

Before a key is released, the guard marks it departed from each old partition, durably
(``state.departed``): a new owner of an old partition skips the key's records the mark covers, so
that a Redis that lost its settled sets cannot hand them out after the key's later records.

The history (``state.counts``) is read when the engine starts, and grows when the guard learns of a
growth: a partition claimed beyond the known count, a fetched record stamped with a higher count,
or the topic's metadata read every ``METADATA_INTERVAL`` seconds (a growth made by Kafka's own
tools, with no record yet). The check runs on the guard's own thread, so the coordinator never
waits for it: it reads the held keys' old partitions (``OldPartitions``) and sends the keys whose
old records are all settled back to the coordinator (``MovesCleared``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis
from confluent_kafka import KafkaException

from ordering_layer.errors import OrderingLayerError
from ordering_layer.kafka_config import connection_settings
from ordering_layer.state import StateStore
from ordering_layer.state.counts import History, PartitionCounts, normalised, report_held
from ordering_layer.state.departed import Departed, DepartedKeys
from ordering_layer.subscriber.old_partitions import OldPartitions, old_partitions
from ordering_layer.subscriber.owned_partition import OwnedPartition
from ordering_layer.subscriber.requests import CountsChanged, Fetched, MovesCleared
from ordering_layer.worker import Worker, run_bounded

_LOGGER = logging.getLogger(__name__)

METADATA_INTERVAL = 2.0  # seconds between reads of the topic's partition count
CHECK_INTERVAL = 0.05  # seconds between checks while keys are held
CLOSE_WAIT = 1.0  # seconds close waits for the guard's thread and clients
_KAFKA_TIMEOUT = 10.0

Owned = Mapping[int, OwnedPartition]
MOVE_EVENTS = (MovesCleared, CountsChanged)  # what the guard's thread posts, for ``MoveGuard.route``


def now_ms() -> int:
    return int(time.time() * 1000)


class MoveGuard:
    """The count history of one engine's topic and the check of its moved keys.

    Args:
        kafka_config: the subscriber's Kafka settings (its clients take the connection settings).
        store: the Redis state store (settled offsets, floors; the history's hash).
        subscription: the subscription (its group's committed offsets are read, never committed).
        topic: the subscription's topic.
        post: where cleared keys and a grown history go (the engine's inbox).
    """

    def __init__(self, kafka_config: Mapping[str, Any], store: StateStore, subscription: str, topic: str,
                 post: Callable[[Any], None]) -> None:
        self._kafka = connection_settings(kafka_config)
        self._store = store
        self._history_store: PartitionCounts | None = None
        self._departed_store: DepartedKeys | None = None
        self._mark_failures = 0  # departure-mark writes failed in a row
        self._prepared = False  # the departure marks' writer is made (after a growth, before a key clears)
        self.subscription = subscription
        self.topic = topic
        self._post = post
        self._lock = threading.Lock()
        self._work = threading.Event()
        self.history: History = []
        self.owned: Owned = {}  # the engine's owned partitions (set by the engine; its lock held to use them)
        self._held: dict[tuple[int, int], dict[bytes, int]] = {}  # (partition, epoch) -> key -> count
        self._warm: set[int] = set()  # old partitions read ahead after a growth, until nothing there can hold a key
        self._old = OldPartitions(self._kafka, store, subscription, topic)
        self._next_metadata = 0.0
        self._reported: dict[int, int] = {}
        self._report_due = 0.0
        self._worker = Worker(f"ordering-layer-moves-{subscription}", self._step)

    # -- coordinator side ------------------------------------------------------------------------
    def start(self) -> None:
        """Read the history (the guard's thread records the topic's count when it is new) and start
        the guard's thread."""
        try:
            self.history = self._counts.history(self.topic)
        except (redis.RedisError, OrderingLayerError) as exc:
            _LOGGER.warning("%s: the partition-count history of %s not read (%s); reading it again", self.subscription,
                            self.topic, exc)
        self._worker.start()

    def close(self) -> None:
        """Stop the thread and close the guard's Kafka clients, waiting ``CLOSE_WAIT`` seconds at most
        (with the brokers down a metadata read or a client's close waits much longer; the rest goes
        on in the background)."""
        self._work.set()
        self._worker.stop(CLOSE_WAIT)

        def close_clients() -> None:
            self._worker.stop()
            self._old.close()
            for store in (self._history_store, self._departed_store):
                if store is not None:
                    store.close()

        if not run_bounded(f"ordering-layer-moves-close-{self.subscription}", close_clients, CLOSE_WAIT):
            _LOGGER.info("%s: the move guard's Kafka clients close in the background", self.subscription)

    def counts_for(self, partition: int) -> History:
        """The history a newly claimed ``partition`` takes (a partition beyond the known count is a
        growth, recorded first with the count the topic's metadata gives: the claim may come
        before the metadata shows the partitions a growth added after it)."""
        with self._lock:
            history = self.history
        if history and partition >= history[-1][0]:
            history = self.grow(max(partition + 1, self._partition_count() or 0))
        return history

    def grow(self, count: int) -> History:
        """The topic has at least ``count`` partitions: record it, and give the owned partitions the
        history (a no-op for a count known already)."""
        with self._lock:
            known = self.history
        if not known or count <= known[-1][0]:
            return known
        history = self._record(count)
        self.apply(history)
        return history

    def apply(self, history: History) -> None:
        """Give every owned partition's core a grown history."""
        with self._lock:
            if len(history) <= len(self.history):
                return
            if self.history:
                # Read the old partitions from now on, before any moved key is held: their backlog
                # is indexed by the time the new partitions are fetched.
                self._warm |= set(range(self.history[-1][0]))
            self.history = history
        self._work.set()
        if len(history) > 1:
            for partition, state in self.owned.items():
                state.core.set_moves(partition, history)

    def take(self, fetched: Fetched, take: Callable[[Fetched], None]) -> None:
        """Hand a fetched batch to the partitions (``take``) under the history its counts tell of
        (a growth first), then collect the keys the cores held for it."""
        self.grow(fetched.highest_count)
        take(fetched)
        self.collect()

    def collect(self) -> None:
        """Take the keys the cores held for a move since the last call, for the guard's thread."""
        if len(self.history) < 2:
            return
        taken = {(partition, state.epoch): state.core.take_moved() for partition, state in self.owned.items()}
        with self._lock:
            current = set(taken)
            for gone in [entry for entry in self._held if entry not in current]:
                del self._held[gone]  # revoked, lost or claimed again: its holds are gone with it
            for entry, keys in taken.items():
                if keys:
                    self._held.setdefault(entry, {}).update(keys)
            if not any(self._held.values()):
                return
        self._work.set()

    def route(self, event: MovesCleared | CountsChanged) -> None:
        """Apply what the guard's thread posted: a grown history, or cleared keys (released in a
        partition still owned under the same epoch)."""
        if isinstance(event, CountsChanged):
            self.apply(event.history)
            return
        state = self.owned.get(event.partition)
        if state is not None and state.epoch == event.epoch:
            for key in event.keys:
                state.core.clear_moved(key)

    def departed_for(self, partition: int) -> list[Departed]:
        """The marks of keys that left ``partition`` (all seek generations).

        Raises:
            redis.RedisError, OrderingLayerError: Redis or the durable copy could not be read.
        """
        return self._departed.for_partition(partition)

    def holding(self) -> int:
        """Keys held for a move and not cleared yet, all partitions."""
        with self._lock:
            return sum(len(keys) for keys in self._held.values())

    # -- the guard's thread ----------------------------------------------------------------------
    @property
    def _counts(self) -> PartitionCounts:
        if self._history_store is None:
            self._history_store = PartitionCounts(self._store.client, self._kafka)
        return self._history_store

    @property
    def _departed(self) -> DepartedKeys:
        if self._departed_store is None:
            self._departed_store = DepartedKeys(self._store.client, self._kafka, self.subscription)
        return self._departed_store

    def _mark(self, cleared: Mapping[bytes, int], partition: int, history: History) -> bool:
        """Mark ``cleared`` keys (key -> count they waited for in ``partition``) departed from their
        old partitions up to where those were read; False when the marks could not be written."""
        try:
            generation = self._store.seek_announced(self.subscription)
            marks = self._old.departures(cleared, partition, history, generation)
            self._departed.record(marks)
        except (redis.RedisError, OrderingLayerError) as exc:
            self._mark_failures += 1
            level = logging.WARNING if self._mark_failures % 100 == 1 else logging.DEBUG
            _LOGGER.log(level, "%s: marking %d cleared keys departed failed (%s, %d in a row); they wait",
                        self.subscription, len(cleared), exc, self._mark_failures)
            return False
        self._mark_failures = 0
        self._old.marked(marks)
        return True

    def _prepare(self) -> None:
        """Make the departure marks' writer as soon as the topic is known to have grown: the first
        keys cleared do not wait for a new producer and its topic."""
        try:
            self._departed.prepare()
        except (redis.RedisError, OrderingLayerError) as exc:
            _LOGGER.info("%s: the departure marks' writer not made yet (%s)", self.subscription, exc)
            return
        self._prepared = True

    def _record(self, count: int) -> History:
        try:
            return self._counts.record(self.topic, count, now_ms())
        except (redis.RedisError, OrderingLayerError) as exc:
            # Holds must not wait for Redis: the count is kept here and recorded at the next growth seen.
            _LOGGER.warning("%s: recording %d partitions of %s failed (%s)", self.subscription, count, self.topic,
                            exc)
            with self._lock:
                return normalised([*self.history, (count, now_ms())])

    def _step(self) -> float:
        with self._lock:
            waiting = any(self._held.values()) or bool(self._warm)
        self._work.wait(CHECK_INTERVAL if waiting else METADATA_INTERVAL / 4)
        self._work.clear()
        if time.monotonic() >= self._next_metadata:
            self._next_metadata = time.monotonic() + METADATA_INTERVAL
            self._read_count()
        if not self._prepared and len(self.history) > 1:
            self._prepare()
        self._report()  # keys held since the last step, before a check that may read for long
        self._check()
        self._report()
        return 0.0

    def _report(self) -> None:
        """Tell Redis how many keys each owned partition holds for a move (``describe``): on each
        change, and every ``METADATA_INTERVAL`` while any are held (the hash expires otherwise)."""
        with self._lock:
            holding = {partition: len(keys) for (partition, _), keys in self._held.items()}
        if holding == self._reported and not (any(holding.values()) and time.monotonic() >= self._report_due):
            return
        try:
            report_held(self._store.client, self.subscription, self._reported, holding, int(10 * METADATA_INTERVAL))
        except redis.RedisError as exc:
            _LOGGER.debug("%s: keys held for a move not reported: %s", self.subscription, exc)
            return
        self._reported = holding
        self._report_due = time.monotonic() + METADATA_INTERVAL

    def _partition_count(self) -> int | None:
        """The topic's partition count by its metadata (None: not read)."""
        try:
            metadata = self._old.consumer().list_topics(self.topic, timeout=_KAFKA_TIMEOUT).topics.get(self.topic)
        except KafkaException as exc:
            _LOGGER.debug("%s: reading the partition count of %s failed: %s", self.subscription, self.topic, exc)
            return None
        return None if metadata is None or metadata.error is not None else len(metadata.partitions)

    def _read_count(self) -> None:
        count = self._partition_count()
        with self._lock:
            known = self.history[-1][0] if self.history else 0
        if count is not None and count > known:
            history = self._record(count)
            if known:
                self._post(CountsChanged(history))
            else:
                with self._lock:
                    self.history = history

    def _check(self) -> None:
        with self._lock:
            held = {entry: dict(keys) for entry, keys in self._held.items() if keys}
            history, warm = self.history, set(self._warm)
        if len(history) < 2:
            return
        # What each hold waits for: its key's records below its count in its old partitions. A key
        # can be held in two partitions at once (it moved away and back: 4 -> 16 -> 4), each for its
        # own count, so the answers are per old partition and count, never per key alone.
        needed: dict[tuple[int, int], set[bytes]] = {}  # (old partition, count) -> keys
        for (partition, _), keys in held.items():
            for key, count in keys.items():
                for old in old_partitions(key, partition, count, history):
                    needed.setdefault((old, count), set()).add(key)
        if not needed and not warm:
            self._old.forget()
            return
        waiting: set[tuple[int, int, bytes]] = set()  # (old partition, count, key)
        try:
            self._old.refresh({old for old, _ in needed} | warm, history)
            for (old, count), waiters in needed.items():
                waiting |= {(old, count, key) for key in self._old.unsettled(old, dict.fromkeys(waiters, count))}
            for old in warm:
                if not self._old.pending(old):
                    with self._lock:
                        self._warm.discard(old)  # every record a moved key could wait for there is settled
        except (KafkaException, redis.RedisError) as exc:
            _LOGGER.info("%s: old partitions not read for moved keys (%s); trying again", self.subscription, exc)
            return
        for (partition, epoch), keys in held.items():
            cleared = [key for key, count in keys.items() if not any(
                (old, count, key) in waiting for old in old_partitions(key, partition, count, history))]
            if not cleared or not self._mark({key: keys[key] for key in cleared}, partition, history):
                continue
            with self._lock:
                entry = self._held.get((partition, epoch))
                for key in cleared:
                    if entry is not None:
                        entry.pop(key, None)
            self._post(MovesCleared(partition, epoch, cleared))

