"""The subscriber engine shared by ``Subscriber.subscribe``, ``Subscriber.pull`` and ``OrderedConsumer``.

Two threads and one lock:

* the *fetch* thread owns ``Consumer.consume`` (and so the rebalance callbacks): it decodes records
  once and posts them to the engine's inbox; on assignment it claims partitions in Redis (new epoch,
  settled offsets, attempts), on revoke it waits for the partitions' outstanding deliveries, flushes,
  commits and lets go;
* the *engine* thread takes everything else from the inbox (records, acks, nacks, deadline changes,
  pull requests), releases what each key may release, records the attempts and leases in Redis in
  one pipeline *before* handing the messages out, expires leases, commits offsets and applies flow
  control by holding, then pausing, the fetch.

User code never touches this state: it posts ``Settle`` requests, which wake the engine at once.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import redis
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka import Message as KafkaMessage

from ordering_layer.config import FlowControl, SubscriptionSettings
from ordering_layer.record import HeaderPairs, display_key, encode, read_metadata
from ordering_layer.state import ApplyResult, StateStore
from ordering_layer.state.store import Op, OpKind, OpLetter
from ordering_layer.subscriber.histogram import Histogram, extension_seconds
from ordering_layer.subscriber.inbox import Inbox
from ordering_layer.subscriber.message import AckResponse, Message, Settle
from ordering_layer.subscriber.partition import Delivery, PartitionState, QueueKey, Record
from ordering_layer.worker import Worker

_LOGGER = logging.getLogger(__name__)

_FETCH_BATCH = 500
_PAUSED_POLL = 0.005
_FLUSH_MAX_OPS = 500
_FLUSH_MAX_AGE = 0.005
_GATHER = 0.002
_COMMIT_INTERVAL = 1.0
_MAX_BUFFERED = 20_000
_RESUME_FRACTION = 0.8
# Over the flow-control limit the fetch thread first only stops taking records from the consumer:
# librdkafka keeps what it prefetched (bounded by its queued.* settings). A real pause() throws that
# prefetch away and costs a refetch of ~0.2-0.5 s on resume, so it is used only when the limit
# holds longer than this (and rebalance callbacks, served by consume(), must not wait long).
_HOLD_BEFORE_PAUSE = 1.0
_REVOKE_GRACE = 30.0
_REQUEUE_DELAY = 1.0  # after a failed Redis or dead-letter write: the write is retried, no failure counted
_MALFORMED_LOGGED = 10  # malformed-metadata warnings logged one by one; then every 1000th

DLQ_HEADERS = ("ol-dlq-source-topic", "ol-dlq-source-partition", "ol-dlq-source-offset",
               "ol-dlq-sequence-number", "ol-dlq-key", "ol-dlq-attempts", "ol-dlq-last-error",
               "ol-dlq-subscription", "ol-dlq-reason")


RebalanceCallback = Callable[[list[TopicPartition]], None]


class RebalanceHooks(NamedTuple):
    """User code told of partitions assigned, revoked (before they are let go) and lost."""

    on_assign: RebalanceCallback | None = None
    on_revoke: RebalanceCallback | None = None
    on_lost: RebalanceCallback | None = None


def _tell(callback: RebalanceCallback | None, partitions: list[TopicPartition], what: str) -> None:
    if callback is None:
        return
    try:
        callback(partitions)
    except Exception:
        _LOGGER.exception("%s callback failed", what)


class _Fetched(NamedTuple):
    """Records as ``consume`` returned them, with each partition's assignment generation then:
    records of an earlier generation were fetched for an ownership that has ended since."""

    records: list[Record]
    generations: dict[int, int]


class _Pull(NamedTuple):
    max_messages: int
    deadline: float
    future: Future[list[Message]]


class _Committed(NamedTuple):
    offsets: list[tuple[int, int]]


class _DeadLettered(NamedTuple):
    partition: int
    epoch: int
    queue_key: QueueKey
    offset: int
    error: str | None


@dataclass(slots=True)
class _Outstanding:
    token: int
    record: Record
    queue_key: QueueKey
    deadline: float
    first_delivery: float
    check: float = 0.0  # when the lease is looked at next; only the lease watch of this time acts


def to_record(msg: KafkaMessage) -> Record:
    """A fetched Kafka record with its layer metadata read once; any record is a message (PUB-7)."""
    key, value = msg.key(), msg.value()
    headers = cast(HeaderPairs | None, msg.headers())  # a list of pairs for fetched records
    partition, offset = msg.partition(), msg.offset()
    assert partition is not None and offset is not None
    return Record(partition, offset, key or None, value, headers, read_metadata(headers),
                  len(value) if value else 0, msg.timestamp()[1])


class Engine:
    """Ordered (or unordered) dispatch of one subscription at one subscriber.

    Args:
        kafka_config: confluent-kafka settings (passed through; group, commits and assignor are set).
        store: the Redis state store.
        subscription: subscription name (the Kafka consumer group).
        settings: the subscription's stored settings.
        flow_control: limits on outstanding messages and bytes (SUB-7).
        on_messages: callback mode: receives each released batch (one message per key at a time);
            None for pull mode, where ``pull`` releases on demand.
        rebalance: user callbacks told of assignments, revocations and losses (after the engine
            has claimed, resp. before it lets go), on the fetch thread.
    """

    def __init__(self, kafka_config: Mapping[str, Any], store: StateStore, subscription: str,
                 settings: SubscriptionSettings, *, flow_control: FlowControl,
                 on_messages: Callable[[list[Message]], None] | None,
                 rebalance: RebalanceHooks | None = None) -> None:
        self.subscription = subscription
        self.settings = settings
        self.topic = settings.topic
        self.flow_control = flow_control
        self._store = store
        self._on_messages = on_messages
        self._rebalance = rebalance or RebalanceHooks()
        conf = {k: v for k, v in kafka_config.items() if k != "group.id"}
        conf.update({"group.id": subscription, "enable.auto.commit": False, "enable.auto.offset.store": False,
                     "auto.offset.reset": "earliest", "partition.assignment.strategy": "cooperative-sticky"})
        conf.setdefault("logger", logging.getLogger("ordering_layer.kafka.consumer"))
        conf["on_commit"] = self._on_commit
        self._consumer = Consumer(conf)
        self._producer_config = {k: v for k, v in kafka_config.items()
                                 if not k.startswith(("group.", "session.", "heartbeat.", "max.poll", "auto.",
                                                      "enable.auto", "partition.assignment", "isolation"))}
        self._dlq_producer: Producer | None = None
        self._inbox: Inbox[Any] = Inbox()
        self._consumer_calls: queue.SimpleQueue[Callable[[], Any]] = queue.SimpleQueue()
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._partitions: dict[int, PartitionState] = {}
        self._generations: dict[int, int] = {}  # fetch thread: bumped on each assign, revoke, loss
        self._unclaimed: dict[int, tuple[int, list[Record]]] = {}  # generation, records waiting
        self._ops: dict[int, list[Op]] = {}
        self._ack_futures: dict[int, list[Future[AckResponse]]] = {}
        self._oldest_op = 0.0
        self._op_count = 0
        self._out: dict[tuple[int, int], _Outstanding] = {}
        self._out_bytes = 0
        self._leases: list[tuple[float, int, list[tuple[int, int]]]] = []
        self._lease_seq = itertools.count()
        self._histogram = Histogram()
        self._latencies: list[float] = []
        self._parked: set[bytes] = set()
        self._pulls: deque[_Pull] = deque()
        self._committed: dict[int, int] = {}
        self._last_commit = 0.0
        self._fetch_held = False  # engine: over the flow-control limit, take no records
        self._held_since = 0.0
        self._fetch_paused = False  # fetch thread: the assignment is paused in the consumer
        self._closing = False
        self.malformed_records = 0  # records whose ol- metadata was ignored (DLQ-4)
        self._fetcher = Worker(f"ordering-layer-fetch-{subscription}", self._fetch_step)
        self._engine = Worker(f"ordering-layer-engine-{subscription}", self._engine_step)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Join the group and start dispatching."""
        self._refresh_parked()
        self._consumer.subscribe([self.topic], on_assign=self._on_assign, on_revoke=self._on_revoke,
                                 on_lost=self._on_lost)
        self._engine.start()
        self._fetcher.start()

    def close(self, timeout: float = 30.0) -> None:
        """Stop releasing, wait up to ``timeout`` for outstanding deliveries, commit, leave the group."""
        with self._lock:
            self._closing = True
            deadline = time.monotonic() + timeout
            while self._out and time.monotonic() < deadline:
                self._changed.wait(0.05)
        self._fetcher.stop()
        self._engine.stop()
        with self._lock:
            self._drain_inbox()
            self._flush()
            self._commit(sync=True)
            for pull in self._pulls:
                pull.future.set_result([])
            self._pulls.clear()
        try:
            self._consumer.close()
        except (KafkaException, RuntimeError) as exc:
            _LOGGER.warning("closing consumer of %s: %s", self.subscription, exc)
        if self._dlq_producer is not None:
            self._dlq_producer.flush(10)

    def submit(self, request: Settle) -> None:
        """Post an ack, nack or deadline change (called from user threads)."""
        self._inbox.put(request)

    def pull(self, max_messages: int, timeout: float) -> list[Message]:
        """Release up to ``max_messages`` (at most one batch per key), waiting up to ``timeout`` s."""
        future: Future[list[Message]] = Future()
        self._inbox.put(_Pull(max_messages, time.monotonic() + timeout, future))
        return future.result(timeout + 30.0)

    def stats(self) -> dict[str, int]:
        """Outstanding messages and bytes, buffered records, owned partitions."""
        with self._lock:
            return {"outstanding": len(self._out), "outstanding_bytes": self._out_bytes,
                    "buffered": sum(p.buffered for p in self._partitions.values()),
                    "partitions": len(self._partitions), "fetch_held": int(self._fetch_held),
                    "fetch_paused": int(self._fetch_paused)}

    @property
    def consumer(self) -> Consumer:
        """The Kafka consumer, for metadata queries only (librdkafka serves them from any thread)."""
        return self._consumer

    def assigned_partitions(self) -> list[int]:
        """Partitions this subscriber owns now."""
        with self._lock:
            return sorted(self._partitions)

    # -- fetch thread ----------------------------------------------------------------------------
    def _fetch_step(self) -> float:
        # Only this thread calls the consumer while it runs: librdkafka's consumer is not safe for
        # concurrent calls from Python threads, so the engine queues commits and pause/resume here.
        while True:
            try:
                call = self._consumer_calls.get_nowait()
            except queue.Empty:
                break
            try:
                call()
            except KafkaException as exc:
                _LOGGER.warning("%s: consumer call failed: %s", self.subscription, exc)
        if self._fetch_held:
            if not self._fetch_paused:
                if time.monotonic() - self._held_since < _HOLD_BEFORE_PAUSE:
                    return _PAUSED_POLL  # SUB-7: no records taken while over the limit
                self._pause_assignment(True)
        elif self._fetch_paused:
            self._pause_assignment(False)
        messages = self._consumer.consume(_FETCH_BATCH, _PAUSED_POLL if self._fetch_paused else 0.1)
        records = []
        for msg in messages:
            if msg.error() is not None:
                _LOGGER.warning("fetch error on %s: %s", self.subscription, msg.error())
                continue
            record = to_record(msg)
            if record.metadata.malformed is not None:
                self._malformed_metadata(record)
            records.append(record)
        if records:
            self._inbox.put(self._fetched(records))
        return 0.0

    def _fetched(self, records: list[Record]) -> _Fetched:
        """Fetch thread: tag records just returned by ``consume`` with the assignment generations."""
        return _Fetched(records, dict(self._generations))

    def _next_generation(self, partitions: list[TopicPartition]) -> None:
        """Fetch thread: a partition's ownership changed; what was fetched before belongs to the old one."""
        generations = self._generations
        for tp in partitions:
            generations[tp.partition] = generations.get(tp.partition, 0) + 1

    def _malformed_metadata(self, record: Record) -> None:
        """DLQ-4: malformed ``ol-`` headers are ignored; the record is delivered as a plain record."""
        self.malformed_records += 1
        count = self.malformed_records
        if count <= _MALFORMED_LOGGED or count % 1000 == 0:
            _LOGGER.warning("%s: record %d:%d has malformed layer metadata (%s), ignored; delivered as a plain "
                            "record (%d such records so far)", self.subscription, record.partition,
                            record.offset, record.metadata.malformed, count)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._next_generation(partitions)
        for tp in partitions:
            self._claim(tp.partition, self._generations[tp.partition])
        # Assigned here rather than by the client after this callback, so that the new partitions
        # join the fetch gate's state before their first fetch: paused while the assignment is
        # paused (SUB-7), and resumed otherwise, as librdkafka may keep a pause from an earlier
        # ownership of the partition, which no later resume of the then assignment reached.
        consumer.incremental_assign(partitions)
        self._pause(partitions, self._fetch_paused)
        _tell(self._rebalance.on_assign, partitions, "on_assign")

    def _claim(self, partition: int, generation: int) -> bool:
        """Claim a partition assigned under ``generation``; on a Redis failure its records wait for
        a retry (made when more of them arrive)."""
        try:
            claimed = self._store.claim(self.subscription, partition)
        except redis.RedisError as exc:
            _LOGGER.warning("claiming partition %d of %s failed (%s); retrying", partition, self.subscription, exc)
            with self._lock:
                entry = self._unclaimed.get(partition)
                if entry is None or entry[0] != generation:
                    self._unclaimed[partition] = (generation, [])
            return False
        with self._lock:
            state = self._partitions[partition] = PartitionState(
                partition, claimed.epoch, ordered=self.settings.enable_message_ordering,
                settled_before=claimed.settled, attempts_before=claimed.attempts, generation=generation)
            waited, waiting = self._unclaimed.pop(partition, (generation, []))
            if waited == generation:
                for record in waiting:
                    state.add(record)
        _LOGGER.info("%s: claimed partition %d (epoch %d, %d settled above the commit)",
                     self.subscription, partition, claimed.epoch, len(claimed.settled))
        return True

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._next_generation(partitions)
        _tell(self._rebalance.on_revoke, partitions, "on_revoke")
        numbers = [tp.partition for tp in partitions]
        with self._lock:
            for number in numbers:
                state = self._partitions.get(number)
                if state is not None:
                    state.revoking = True
            # Affinity (SUB-5): let the deliveries in progress finish before the key can move.
            deadline = time.monotonic() + min(self.settings.ack_deadline, _REVOKE_GRACE)
            while any(key[0] in numbers for key in self._out) and time.monotonic() < deadline:
                self._changed.wait(0.05)
            self._flush()
            self._commit(sync=True, only=numbers)
            for number in numbers:
                self._drop(number)

    def _on_commit(self, err: Any, partitions: list[TopicPartition]) -> None:
        """A commit reached the group coordinator: only now may Redis forget what lies below it."""
        if err is None:
            done = [(tp.partition, tp.offset) for tp in partitions
                    if tp.error is None and tp.topic == self.topic and tp.offset >= 0]
            if done:
                self._inbox.put(_Committed(done))

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._next_generation(partitions)
        with self._lock:
            for tp in partitions:
                self._drop(tp.partition)
        _tell(self._rebalance.on_lost, partitions, "on_lost")

    # -- engine thread ---------------------------------------------------------------------------
    def _engine_step(self) -> float:
        with self._lock:
            wait = self._wait_time()
        inbox = self._inbox
        # When busy (more than one event waiting) keep gathering for up to _GATHER seconds so that
        # one Redis round trip serves many messages (ACK-4's batching); a lone event (an idle
        # subscriber) is handled at once.
        if inbox.wait(1, wait) and len(inbox) > 1:
            inbox.wait(_FLUSH_MAX_OPS, _GATHER)
        events = inbox.take()
        with self._lock:
            now = time.monotonic()
            for event in events:
                self._handle(event, now)
            if self._latencies:
                self._histogram.add_many(self._latencies)
                self._latencies = []
            self._expire(now)
            deliveries = self._release(now)
            if self._dlq_producer is not None:
                self._dlq_producer.poll(0)
            flush_due = self._op_count >= _FLUSH_MAX_OPS or (
                self._op_count > 0 and now - self._oldest_op >= _FLUSH_MAX_AGE)
            if (deliveries or flush_due) and not self._flush():
                deliveries = self._unrelease(deliveries, now)
            self._dispatch(deliveries, now)
            self._expire_pulls(now)
            if now - self._last_commit >= _COMMIT_INTERVAL:
                self._commit(sync=False)
                self._refresh_parked()
            self._apply_flow_control()
            self._changed.notify_all()
        return 0.0

    def _wait_time(self) -> float:
        wait = 0.1
        now = time.monotonic()
        if self._op_count:
            wait = min(wait, max(0.0, self._oldest_op + _FLUSH_MAX_AGE - now))
        if self._leases:
            wait = min(wait, max(0.0, self._leases[0][0] - now))
        if self._pulls:
            wait = min(wait, max(0.0, self._pulls[0].deadline - now))
        for state in self._partitions.values():
            wake = state.next_wake()
            if wake is not None:
                wait = min(wait, max(0.0, wake - now))
        return wait

    def _drain_inbox(self) -> None:
        now = time.monotonic()
        for event in self._inbox.take():
            if not isinstance(event, _Pull):
                self._handle(event, now)
            else:
                event.future.set_result([])

    def _handle(self, event: Any, now: float) -> None:
        if isinstance(event, Settle):
            self._settle(event, now)
        elif isinstance(event, _Fetched):
            self._take_fetched(event)
        elif isinstance(event, _Pull):
            self._pulls.append(event)
        elif isinstance(event, _Committed):
            # Trimming before the commit succeeded would make a new owner redeliver acked messages.
            for partition, offset in event.offsets:
                if partition in self._partitions:
                    self._queue_op(partition, (OpKind.WATERMARK, 0, offset), now)
        elif isinstance(event, _DeadLettered):
            state = self._partitions.get(event.partition)
            if state is not None and state.epoch == event.epoch:
                if event.error is None:
                    self._forget(event.partition, event.offset)
                    state.settle_dead_lettered(event.queue_key, event.offset)
                    self._queue_op(event.partition, (OpKind.SETTLED, event.offset, 0), now)
                else:
                    out = self._out.get((event.partition, event.offset))
                    if out is not None:
                        self._forget(event.partition, event.offset)
                        state.requeue(event.queue_key, event.offset, out.token, now, _REQUEUE_DELAY)

    def _take_fetched(self, event: _Fetched) -> None:
        """Hand fetched records to the ownership they were fetched for. A record of an earlier
        generation is dropped: the partition's current owner (this subscriber again, or another)
        fetches it again from the committed offset, and taking it here would make that refetch look
        like duplicates (SUB-3)."""
        partitions, unclaimed, generations = self._partitions, self._unclaimed, event.generations
        for record in event.records:
            generation = generations.get(record.partition)
            state = partitions.get(record.partition)
            if state is not None:
                if state.generation == generation:
                    state.add(record)
                continue
            entry = unclaimed.get(record.partition)
            if entry is not None and entry[0] == generation:
                entry[1].append(record)
        for partition, (generation, waiting) in list(unclaimed.items()):
            if waiting:
                self._claim(partition, generation)

    def _settle(self, request: Settle, now: float) -> None:
        partition, offset = request.partition, request.offset
        state = self._partitions.get(partition)
        if state is None or state.epoch != request.epoch:
            _resolve(request.future, AckResponse.LEASE_LOST)
            return
        key = (partition, offset)
        out = self._out.get(key)
        if out is None or out.token != request.token:
            _resolve(request.future, AckResponse.INVALID_ACK_ID)
            return
        kind = request.kind
        if kind == "ack":
            self._latencies.append(now - out.first_delivery)
            state.ack(request.queue_key, offset, request.token)
            self._queue_op(partition, (OpKind.SETTLED, offset, 0), now)
        elif kind == "deadline":
            out.deadline = now + request.seconds
            self._watch_lease(key, out)
            self._queue_op(partition, (OpKind.LEASE, offset, _wall_ms(request.seconds)), now)
            self._queue_future(partition, request.future)
            return
        else:
            state.nack(request.queue_key, offset, request.token, now, self.settings.retry_policy.backoff)
            if request.error:
                out.record.last_error = request.error
            self._queue_op(partition, (OpKind.NACKED, offset, 0), now)
        del self._out[key]
        self._out_bytes -= out.record.size
        if request.future is not None:
            self._queue_future(partition, request.future)

    def _expire(self, now: float) -> None:
        """Leases: extend those still held (ACK-2), give back those that lapsed (ACK-1, SUB-4).

        A heap entry is a time to look at one delivery: shortly before its deadline it is extended
        by the p99 ack latency unless it has been held for ``max_lease_duration``; at its deadline
        it lapses and its key is rewound to it.
        """
        settings = self.settings
        leases = self._leases
        while leases and leases[0][0] <= now:
            check, _, keys = heapq.heappop(leases)
            for key in keys:
                out = self._out.get(key)
                if out is None or out.check != check:
                    continue  # settled, or watched again since (a new deadline, a redelivery)
                partition, offset = key
                state = self._partitions.get(partition)
                if state is None:
                    continue
                if now >= out.deadline - _lease_margin(settings.ack_deadline) and now < out.deadline \
                        and now - out.first_delivery < settings.max_lease_duration:
                    seconds = extension_seconds(self._histogram,
                                                min_extension=settings.min_duration_per_lease_extension,
                                                max_extension=settings.max_duration_per_lease_extension)
                    out.deadline = now + seconds
                    self._queue_op(partition, (OpKind.LEASE, offset, _wall_ms(seconds)), now)
                    self._watch_lease(key, out)
                elif now >= out.deadline:
                    _LOGGER.info("%s: lease of %d:%d lapsed; redelivering", self.subscription, partition, offset)
                    state.nack(out.queue_key, offset, out.token, now, settings.retry_policy.backoff)
                    self._forget(partition, offset)
                    self._queue_op(partition, (OpKind.NACKED, offset, 0), now)
                else:
                    self._watch_lease(key, out, check=out.deadline)

    def _watch_lease(self, key: tuple[int, int], out: _Outstanding, check: float | None = None) -> None:
        """Look at this delivery again at ``check``, by default shortly before its deadline
        (extension is jittered)."""
        out.check = self._check_time(out.deadline) if check is None else check
        heapq.heappush(self._leases, (out.check, next(self._lease_seq), [key]))

    def _watch_leases(self, deadline: float, keys: list[tuple[int, int]]) -> None:
        """One lease watch for the deliveries released together (they share their deadline)."""
        check = self._check_time(deadline)
        for key in keys:
            self._out[key].check = check
        heapq.heappush(self._leases, (check, next(self._lease_seq), keys))

    def _check_time(self, deadline: float) -> float:
        return deadline - _lease_margin(self.settings.ack_deadline) * (1.0 - 0.2 * random.random())

    def _release(self, now: float) -> list[Delivery]:
        """Release what may go out now, within flow control: callback mode one per key, pull mode
        whole per-key batches up to the waiting pull's size."""
        if self._closing:
            return []
        limits = self.flow_control
        budget = limits.max_messages - len(self._out)
        if self._on_messages is None:
            if not self._pulls:
                return []
            per_key = self._pulls[0].max_messages
            budget = min(budget, per_key)
        else:
            per_key = 1
        byte_budget = limits.max_bytes - self._out_bytes
        released: list[Delivery] = []
        for state in self._partitions.values():
            if budget <= 0 or byte_budget <= 0:
                break
            if state.revoking:
                continue
            state.wake(now)
            batch = state.release_ready(now, budget, per_key, byte_budget)
            if batch:
                byte_budget -= self._admit(state.partition, batch, now)
                budget -= len(batch)
                released.extend(batch)
        return released

    def _admit(self, partition: int, batch: list[Delivery], now: float) -> int:
        """Take released deliveries as outstanding: their attempts and leases are queued for Redis
        (flushed before anyone sees them) and watched together. Returns their payload bytes."""
        ack_deadline = self.settings.ack_deadline
        deadline = now + ack_deadline
        lease_ms = _wall_ms(ack_deadline)
        outstanding = self._out
        keys = []
        ops: list[Op] = [(OpKind.BATCH_LEASE, 0, lease_ms)]  # the lease of the BATCH_DELIVERED ops after it
        batch_delivered: OpLetter = OpKind.BATCH_DELIVERED
        size = 0
        for delivery in batch:
            record = delivery.record
            offset = record.offset
            key = (partition, offset)
            outstanding[key] = _Outstanding(delivery.token, record, delivery.queue_key, deadline, now)
            keys.append(key)
            size += record.size
            ops.append((batch_delivered, offset, delivery.attempt))
        self._out_bytes += size
        self._queue_ops(partition, ops, now)
        self._watch_leases(deadline, keys)
        return size

    def _unrelease(self, deliveries: list[Delivery], now: float) -> list[Delivery]:
        """Redis did not take the attempt counts: give the deliveries back before anyone sees them (not a
        failure of theirs: their keys' backoff does not grow)."""
        for delivery in deliveries:
            record = delivery.record
            state = self._partitions.get(record.partition)
            self._forget(record.partition, record.offset)
            if state is not None:
                record.attempts -= 1
                state.requeue(delivery.queue_key, record.offset, delivery.token, now, _REQUEUE_DELAY)
        return []

    def _dispatch(self, deliveries: list[Delivery], now: float) -> None:
        if not deliveries:
            return
        messages: list[Message] = []
        partitions, parked, topic, submit = self._partitions, self._parked, self.topic, self.submit
        policy = self.settings.dead_letter_policy
        max_attempts = policy.max_delivery_attempts if policy is not None else None
        for delivery in deliveries:
            record = delivery.record
            state = partitions.get(record.partition)
            if state is None:
                continue  # fenced by the flush that recorded this delivery: the new owner has it
            if max_attempts is not None and delivery.attempt > max_attempts:
                self._dead_letter(state, delivery, "MAX_DELIVERY_ATTEMPTS")
                continue
            if parked and record.key in parked:  # park_key adds to this same set as it goes
                self._dead_letter(state, delivery, "PARKED_KEY")
                continue
            messages.append(Message(delivery, topic, state.epoch, submit))
        if not messages:
            return
        if self._on_messages is not None:
            self._on_messages(messages)
        else:
            self._pulls.popleft().future.set_result(messages)

    def _expire_pulls(self, now: float) -> None:
        while self._pulls and self._pulls[0].deadline <= now:
            self._pulls.popleft().future.set_result([])

    # -- dead letters ----------------------------------------------------------------------------
    def _dead_letter(self, state: PartitionState, delivery: Delivery, reason: str) -> None:
        """Write the record to the dead-letter topic; it settles when the broker has it (DLQ-2, DLQ-4).

        In ``park_key`` mode a key whose message ran out of attempts is parked: its later messages
        follow it into the dead-letter topic, in order, until the key is released.
        """
        record = delivery.record
        policy = self.settings.dead_letter_policy
        assert policy is not None  # only attempts beyond a policy's maximum and parked keys come here
        attempts = delivery.attempt - 1
        last_error = record.last_error
        if (reason == "MAX_DELIVERY_ATTEMPTS" and policy.mode == "park_key"
                and record.key and self.settings.enable_message_ordering):
            self._parked.add(record.key)
            self._store.park_key(self.subscription, record.key)
        sequence = (record.partition << 48) | record.offset
        value = encode("dead_letter", {
            "source_topic": self.topic, "source_partition": record.partition, "source_offset": record.offset,
            "sequence_number": sequence, "subscription": self.subscription, "reason": reason,
            "delivery_attempts": attempts, "last_error": last_error, "key": record.key,
            "value": record.value, "headers": [{"key": k, "value": _header_bytes(v)} for k, v in record.headers or ()]})
        facts = (self.topic, record.partition, record.offset, sequence,
                 display_key(record.key), attempts, last_error or "", self.subscription, reason)
        headers: list[tuple[str, str | bytes | None]] = [
            (name, str(fact).encode()) for name, fact in zip(DLQ_HEADERS, facts, strict=True)]
        if self._dlq_producer is None:
            conf = {**self._producer_config, "enable.idempotence": True, "acks": "all",
                    "logger": logging.getLogger("ordering_layer.kafka.dlq")}
            self._dlq_producer = Producer(conf)
        key = (record.partition, state.epoch, delivery.queue_key, record.offset)

        def delivered(err: Any, _msg: Any) -> None:
            self._inbox.put(_DeadLettered(key[0], key[1], key[2], key[3], None if err is None else str(err)))

        self._dlq_producer.produce(policy.topic, value, key=record.key, headers=headers, on_delivery=delivered)
        self._dlq_producer.poll(0)
        _LOGGER.warning("%s: dead-lettering %d:%d (%s, %d attempts)", self.subscription, record.partition,
                        record.offset, reason, attempts)

    def _refresh_parked(self) -> None:
        """Learn released (and newly parked) keys once per commit interval (park_key mode)."""
        policy = self.settings.dead_letter_policy
        if policy is None or policy.mode != "park_key":
            return
        try:
            self._parked = self._store.parked_keys(self.subscription)
        except redis.RedisError as exc:
            _LOGGER.warning("%s: reading parked keys failed: %s", self.subscription, exc)

    # -- Redis -----------------------------------------------------------------------------------
    def _queue_op(self, partition: int, op: Op, now: float) -> None:
        if not self._op_count:
            self._oldest_op = now
        self._op_count += 1
        self._ops.setdefault(partition, []).append(op)

    def _queue_ops(self, partition: int, ops: list[Op], now: float) -> None:
        if not self._op_count:
            self._oldest_op = now
        self._op_count += len(ops)
        self._ops.setdefault(partition, []).extend(ops)

    def _queue_future(self, partition: int, future: Future[AckResponse] | None) -> None:
        if future is not None:
            self._ack_futures.setdefault(partition, []).append(future)

    def _flush(self) -> bool:
        """Write queued ops of every owned partition in one round trip; False when Redis failed."""
        batches = [(self.subscription, p, self._partitions[p].epoch, ops)
                   for p, ops in self._ops.items() if ops and p in self._partitions]
        futures = self._ack_futures
        if not batches:
            self._ops, self._ack_futures, self._op_count = {}, {}, 0
            for waiting in futures.values():
                for future in waiting:
                    _resolve(future, AckResponse.LEASE_LOST)
            return True
        try:
            results = self._store.apply_many(batches)
        except redis.RedisError as exc:
            _LOGGER.warning("%s: Redis write failed (%s); will retry", self.subscription, exc)
            return False
        self._ops, self._ack_futures, self._op_count = {}, {}, 0
        for (_, partition, _, _), result in zip(batches, results, strict=True):
            status = AckResponse.SUCCESS
            if result == ApplyResult.FENCED:
                _LOGGER.warning("%s: partition %d fenced by a newer owner; dropping it", self.subscription,
                                partition)
                self._drop(partition)
                status = AckResponse.LEASE_LOST
            elif result == ApplyResult.ADOPTED:
                _LOGGER.warning("%s: Redis lost the state of partition %d; re-adopted it", self.subscription,
                                partition)
                self._store.create_settings(self.subscription, self.settings)
            for future in futures.pop(partition, []):
                _resolve(future, status)
        for waiting in futures.values():
            for future in waiting:
                _resolve(future, AckResponse.LEASE_LOST)
        return True

    # -- Kafka commits and flow control ------------------------------------------------------------
    def _commit(self, *, sync: bool, only: list[int] | None = None) -> None:
        """Commit each partition's lowest unsettled offset (ACK-4); trim Redis below it."""
        self._last_commit = time.monotonic()
        offsets = []
        for number, state in self._partitions.items():
            if only is not None and number not in only:
                continue
            watermark = state.tracker.watermark
            # An async commit is only queued for the fetch thread, which may stop before it runs:
            # the sync commits of revoke and close never trust it.
            if watermark is None or (not sync and self._committed.get(number) == watermark):
                continue
            offsets.append(TopicPartition(self.topic, number, watermark))
            self._committed[number] = watermark
        if not offsets:
            return
        if not sync:
            self._consumer_calls.put(lambda: self._consumer.commit(offsets=offsets, asynchronous=True))
            return
        try:
            self._consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            _LOGGER.warning("%s: commit failed: %s", self.subscription, exc)
            for tp in offsets:
                self._committed.pop(tp.partition, None)

    def _apply_flow_control(self) -> None:
        limits = self.flow_control
        buffered = sum(state.buffered for state in self._partitions.values())
        over = (len(self._out) >= limits.max_messages or self._out_bytes >= limits.max_bytes
                or buffered >= _MAX_BUFFERED)
        under = (len(self._out) < limits.max_messages * _RESUME_FRACTION
                 and self._out_bytes < limits.max_bytes * _RESUME_FRACTION
                 and buffered < _MAX_BUFFERED * _RESUME_FRACTION)
        if over and not self._fetch_held:
            self._held_since = time.monotonic()
            self._fetch_held = True
        elif under and self._fetch_held:
            self._fetch_held = False

    def _pause_assignment(self, pause: bool) -> None:
        """Fetch thread: pause or resume the whole assignment in the consumer."""
        self._fetch_paused = pause
        self._pause(self._consumer.assignment(), pause)

    def _pause(self, partitions: list[TopicPartition], pause: bool) -> None:
        """Fetch thread: pause or resume these assigned partitions in the consumer."""
        if partitions:
            try:
                (self._consumer.pause if pause else self._consumer.resume)(partitions)
            except KafkaException as exc:
                _LOGGER.warning("%s: %s failed: %s", self.subscription, "pause" if pause else "resume", exc)

    # -- bookkeeping -----------------------------------------------------------------------------
    def _forget(self, partition: int, offset: int) -> None:
        out = self._out.pop((partition, offset), None)
        if out is not None:
            self._out_bytes -= out.record.size

    def _drop(self, partition: int) -> None:
        """Let go of a partition: its outstanding deliveries can no longer be acked here."""
        state = self._partitions.pop(partition, None)
        self._unclaimed.pop(partition, None)
        self._ops.pop(partition, None)
        self._committed.pop(partition, None)
        for future in self._ack_futures.pop(partition, []):
            _resolve(future, AckResponse.LEASE_LOST)
        for key in [k for k in self._out if k[0] == partition]:
            self._forget(*key)
        if state is not None:
            _LOGGER.info("%s: released partition %d", self.subscription, partition)


def _header_bytes(value: str | bytes | None) -> bytes | None:
    return value.encode() if isinstance(value, str) else value


def _resolve(future: Future[AckResponse] | None, status: AckResponse) -> None:
    if future is not None and not future.done():
        future.set_result(status)


def _lease_margin(ack_deadline: float) -> float:
    """How long before a deadline the lease is extended."""
    return min(2.0, ack_deadline / 5)


def _wall_ms(seconds: float) -> int:
    return int((time.time() + seconds) * 1000)
