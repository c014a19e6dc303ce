"""The engine: one coordinator over the subscriber's components, shared by every front end.

Two threads and one lock. The *fetch* thread (``Fetcher``) owns the Kafka consumer; on assignment it
asks the coordinator to claim the partitions, on revocation to let them go. The *engine* thread runs
the coordinator: it takes everything waiting in the inbox at once (fetched batches, acks, nacks,
deadline changes, pulls, commit and dead-letter reports), routes each typed request to the component
that keeps its state, and applies their verdicts: partitions and key queues release what may go out
(``PartitionState``), within flow control (``FlowGate``); the releases become outstanding leases
(``Leases``); attempts and leases are written to Redis in one pipeline (``StateWriter``) *before* the
messages are handed out (``handoff``) or dead-lettered (``DeadLetters``); commits go back to the fetch
thread as queued requests. The components hold no references to each other.

Seeks (GRP-3) are noticed with the commits, once a second (one Redis read): the owned partitions
with a pending seek are claimed again and restarted at its target (``Partitions.apply_seeks``), their
outstanding deliveries are void (a later ack of one is refused: its epoch is gone), and the fetcher
seeks the consumer.

Attempt counts (ACK-6, DLQ-3): a pull hands a message to user code when it is released, so the
release writes its attempt as delivered. In callback mode a released message may wait in the pool:
the release writes it as released only, and the worker notes when user code starts on it
(``begin``), a note the coordinator writes in its next flush. After a crash the next owner charges
an attempt that was never seen started only up to one below the dead-letter limit, and a worker
records the start of each such suspect message in Redis, synchronously, before user code runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import redis
from confluent_kafka import Consumer, TopicPartition

from ordering_layer.config import FlowControl, SubscriptionSettings
from ordering_layer.state import ApplyResult, StateStore
from ordering_layer.state.store import Op, OpKind, OpLetter
from ordering_layer.subscriber.dead_letters import DeadLetters
from ordering_layer.subscriber.fetcher import Fetcher, RebalanceHooks
from ordering_layer.subscriber.flow import FlowGate, Gate
from ordering_layer.subscriber.handoff import PullWaiters
from ordering_layer.subscriber.inbox import Inbox
from ordering_layer.subscriber.leases import Leases, wall_ms
from ordering_layer.subscriber.message import AckResponse, Message
from ordering_layer.subscriber.metrics import snapshot
from ordering_layer.subscriber.partition import Delivery, PartitionState
from ordering_layer.subscriber.partitions import Partitions
from ordering_layer.subscriber.requests import Committed, DeadLettered, Fetched, Pull, Settle, SettleKind, Sought
from ordering_layer.subscriber.state_writer import StateWriter, resolve
from ordering_layer.worker import Worker

__all__ = ["Engine", "RebalanceHooks"]

_LOGGER = logging.getLogger(__name__)

_GATHER = 0.002
_GATHER_EVENTS = 500
_COMMIT_INTERVAL = 1.0
_REVOKE_GRACE = 30.0
_REQUEUE_DELAY = 1.0  # after a failed Redis or dead-letter write: the write is retried, no failure counted

Released = list[tuple[PartitionState, list[Delivery]]]


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
        track_leases: watch, extend and expire lease deadlines (ACK-1, ACK-2); off only for comparisons.
    """

    def __init__(self, kafka_config: Mapping[str, Any], store: StateStore, subscription: str,
                 settings: SubscriptionSettings, *, flow_control: FlowControl,
                 on_messages: Callable[[list[Message]], None] | None,
                 rebalance: RebalanceHooks | None = None, track_leases: bool = True) -> None:
        self.subscription = subscription
        self.settings = settings
        self.topic = settings.topic
        self.flow_control = flow_control
        self._on_messages = on_messages
        conf = {k: v for k, v in kafka_config.items() if k != "group.id"}
        conf.update({"group.id": subscription, "enable.auto.commit": False, "enable.auto.offset.store": False,
                     "auto.offset.reset": "earliest", "partition.assignment.strategy": "cooperative-sticky"})
        conf.setdefault("logger", logging.getLogger("ordering_layer.kafka.consumer"))
        self._inbox: Inbox[Any] = Inbox()
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._gate = FlowGate(flow_control)
        self._leases = Leases(settings, track=track_leases)
        self._writer = StateWriter(store, subscription)
        self._dead_letters = DeadLetters(kafka_config, store, subscription, settings, self._inbox.put)
        self._pulls = PullWaiters()
        self._fetcher = Fetcher(conf, subscription, self.topic, self._gate, self, self._inbox.put,
                                rebalance or RebalanceHooks())
        self._owned = Partitions(store, subscription, settings)
        self._partitions = self._owned.owned
        self._last_commit = 0.0
        self._seek_seen: int | None = None  # the seek generation announced when last looked
        self._closing = False
        self._counts = {"delivered": 0, "acked": 0, "nacked": 0, "redelivered": 0}
        self._store = store
        # Callback mode: deliveries whose user code started, noted by the workers (deque appends
        # and pops are thread-safe: the hot path takes no lock).
        self._started: deque[Delivery] = deque()
        self._worker = Worker(f"ordering-layer-engine-{subscription}", self._step)

    # -- public ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Join the group and start dispatching."""
        self._dead_letters.refresh_parked()
        self._worker.start()
        self._fetcher.start()

    def close(self, timeout: float = 30.0) -> None:
        """Stop releasing, wait up to ``timeout`` for outstanding deliveries, commit, leave the group."""
        with self._lock:
            self._closing = True
            deadline = time.monotonic() + timeout
            while self._leases.outstanding and time.monotonic() < deadline:
                self._changed.wait(0.05)
        self._fetcher.stop()
        self._worker.stop()
        with self._lock:
            now = time.monotonic()
            self._handle(self._inbox.take(), now)
            self._write_started(now)
            self._pulls.close()
            self._flush()
            offsets = self._offsets(sync=True)
        self._fetcher.commit_sync(offsets)
        with self._lock:
            self._handle(self._inbox.take(), time.monotonic())  # the commit's report: seeks it completes
        self._fetcher.close()
        self._dead_letters.close()

    def submit(self, request: Settle) -> None:
        """Post an ack, nack or deadline change (any thread)."""
        self._inbox.put(request)

    def begin(self, message: Message) -> bool:
        """Callback mode: a worker is about to run user code on ``message`` (ACK-6, DLQ-3).

        The start of a message handed out by an earlier owner and not settled (a suspect: maybe it
        crashed that owner) is written to Redis before this returns; any other start is noted and
        written with the coordinator's next flush. Returns False when user code must not run: the
        delivery was given back or its partition moved meanwhile (its redelivery is on its way), or
        Redis did not take the start (the message is given back without counting a failure).
        """
        delivery = message._delivery
        if not delivery.record.suspect:
            self._started.append(delivery)
            return True
        return self._begin_suspect(delivery, message._epoch)

    def _begin_suspect(self, delivery: Delivery, epoch: int) -> bool:
        record = delivery.record
        partition, offset = record.partition, record.offset
        if not self._holds(delivery, epoch):
            return False
        # The write is made outside the lock (a Redis outage must not stall the coordinator). It
        # cannot pass a settle of this delivery (user code has not run), and the fence stops it
        # once the partition moved; only a lapse meanwhile could come first, checked below.
        try:
            [result] = self._store.apply_many(
                [(self.subscription, partition, epoch, [(OpKind.STARTED, offset, delivery.attempt)])])
        except redis.RedisError as exc:
            _LOGGER.warning("%s: recording the start of %d:%d failed (%s); redelivering it",
                            self.subscription, partition, offset, exc)
            with self._lock:
                state = self._partitions.get(partition)
                if state is not None and self._holds(delivery, epoch):
                    self._leases.pop((partition, offset))
                    record.attempts -= 1
                    state.requeue(delivery.queue_key, offset, delivery.token, time.monotonic(), _REQUEUE_DELAY)
            return False
        with self._lock:
            if result == ApplyResult.FENCED:
                state = self._partitions.get(partition)
                if state is not None and state.epoch == epoch:
                    _LOGGER.warning("%s: partition %d fenced by a newer owner; dropping it", self.subscription,
                                    partition)
                    self.drop(partition)
                return False
            if result == ApplyResult.ADOPTED:
                self._owned.adopted(partition)
            return self._holds(delivery, epoch)

    def _holds(self, delivery: Delivery, epoch: int) -> bool:
        """The delivery is still outstanding here under ``epoch`` (not given back, not moved)."""
        record = delivery.record
        with self._lock:
            state = self._partitions.get(record.partition)
            out = self._leases.outstanding.get((record.partition, record.offset))
            return (state is not None and state.epoch == epoch and out is not None
                    and out.delivery.token == delivery.token)

    def pull(self, max_messages: int, timeout: float) -> list[Message]:
        """Release up to ``max_messages`` (at most one batch per key), waiting up to ``timeout`` s."""
        pull = Pull(max_messages, time.monotonic() + timeout, Future())
        self._inbox.put(pull)
        return pull.future.result(timeout + 30.0)

    @property
    def consumer(self) -> Consumer:
        """The Kafka consumer, for metadata queries only (librdkafka serves them from any thread)."""
        return self._fetcher.consumer

    @property
    def malformed_records(self) -> int:
        """Records whose ``ol-`` metadata was ignored (DLQ-4)."""
        return self._fetcher.malformed_records

    def assigned_partitions(self) -> list[int]:
        """Partitions this subscriber owns now."""
        with self._lock:
            return sorted(self._partitions)

    def stats(self) -> dict[str, int]:
        """Outstanding messages and bytes, buffered records, owned partitions, the fetch gate."""
        with self._lock:
            return {"outstanding": len(self._leases.outstanding), "outstanding_bytes": self._leases.bytes,
                    "buffered": self._owned.buffered(),
                    "partitions": len(self._partitions), "fetch_held": int(self._gate.state is not Gate.OPEN),
                    "fetch_paused": int(self._fetcher.paused)}

    def metrics_snapshot(self) -> dict[str, Any]:
        """Counters, gauges and the observations since the previous call (see ``metrics.snapshot``)."""
        with self._lock:
            return snapshot(self._counts, self._partitions, self._leases, self._writer,
                            dead_lettered=self._dead_letters.written, malformed=self._fetcher.malformed_records,
                            now=time.monotonic())

    # -- ownership (fetch thread) ------------------------------------------------------------------
    def revoking(self, partitions: list[int]) -> list[TopicPartition]:
        """Let revoked partitions go after their deliveries in progress finish (SUB-5); returns the
        offsets to commit."""
        with self._lock:
            for number in partitions:
                state = self._partitions.get(number)
                if state is not None:
                    state.revoking = True
            # Affinity (SUB-5): let the deliveries in progress finish before the keys can move.
            deadline = time.monotonic() + min(self.settings.ack_deadline, _REVOKE_GRACE)
            while any(key[0] in partitions for key in self._leases.outstanding) and time.monotonic() < deadline:
                self._changed.wait(0.05)
            self._flush()
            offsets = self._offsets(sync=True, only=partitions)
            for number in partitions:
                self.drop(number)
            return offsets

    def assigned(self, partitions: list[int], generations: Mapping[int, int]) -> Mapping[int, int]:
        """Claim newly assigned partitions (before their first fetch); returns where a claim applied a
        seek (GRP-3), to start there."""
        starts = {}
        with self._lock:
            for number in partitions:
                if self._owned.claim(number, generations[number], assigning=True):
                    start = self._partitions[number].start_offset
                    if start is not None:
                        starts[number] = start
        return starts

    def lost(self, partitions: list[int]) -> None:
        """Drop lost partitions: another owner has them already."""
        with self._lock:
            for number in partitions:
                self.drop(number)

    def drop(self, partition: int) -> None:
        """Let go of a partition: its outstanding deliveries can no longer be acked here."""
        self._owned.drop(partition)
        self._writer.drop(partition)
        self._leases.drop_partition(partition)

    # -- engine thread ---------------------------------------------------------------------------
    def _step(self) -> float:
        with self._lock:
            wait = self._wait_time(time.monotonic())
        inbox = self._inbox
        # When busy keep gathering for up to _GATHER seconds so that one Redis round trip serves
        # many messages (ACK-4's batching); a lone event (an idle subscriber) is handled at once.
        if inbox.wait(1, wait) and len(inbox) > 1:
            inbox.wait(_GATHER_EVENTS, _GATHER)
        events = inbox.take()
        with self._lock:
            now = time.monotonic()
            self._handle(events, now)
            self._write_started(now)
            self._leases.take_latencies()
            self._expire(now)
            released = self._release(now)
            self._dead_letters.poll()
            if (released or self._writer.due(now)) and not self._flush():
                released = self._unrelease(released, now)
            self._dispatch(released)
            self._pulls.expire(now)
            if now - self._last_commit >= _COMMIT_INTERVAL:
                offsets = self._offsets(sync=False)
                if offsets:
                    self._fetcher.commit(offsets)
                self._dead_letters.refresh_parked()
                self._check_seek()
            self._send_seeks()
            leases = self._leases
            self._gate.update(len(leases.outstanding), leases.bytes,
                              self._owned.buffered(), now)
            self._changed.notify_all()
        return 0.0

    def _wait_time(self, now: float) -> float:
        times = [self._writer.next_due(), self._leases.next_check(), self._pulls.next_deadline(),
                 *(state.next_wake() for state in self._partitions.values())]
        return min([0.1, *(max(0.0, t - now) for t in times if t is not None)])

    def _handle(self, events: list[Any], now: float) -> None:
        settle, fetched = self._settle, self._owned.take
        for event in events:
            kind = type(event)
            if kind is Message:
                settle(SettleKind.ACK, event._delivery, event._epoch, 0.0, None, None, now)
            elif kind is Settle:
                settle(event.kind, event.delivery, event.epoch, event.seconds, event.error, event.future, now)
            elif kind is Fetched:
                fetched(event)
            elif kind is Pull:
                if self._closing:
                    event.future.set_result([])
                else:
                    self._pulls.add(event)
            elif kind is Committed:
                self._committed(event, now)
            elif kind is Sought:
                self._owned.sought(event.partition, event.generation, event.seek_generation)
            elif kind is DeadLettered:
                self._dead_lettered(event, now)

    def _committed(self, event: Committed, now: float) -> None:
        """Commits the group coordinator took: Redis may forget what is settled below them (trimming
        before the commit succeeded would make a new owner redeliver acked messages), unless the
        commit was made before a seek (GRP-3) of the partition; a commit after a seek completes it."""
        for partition, offset, seek_generation in event.offsets:
            state = self._partitions.get(partition)
            if state is not None and seek_generation == state.seek_generation:
                self._writer.add(partition, (OpKind.WATERMARK, 0, offset), now)
            if seek_generation is not None:
                self._owned.confirm(partition, seek_generation)
        for partition in event.failed:
            self._owned.commit_failed(partition)

    def _check_seek(self) -> None:
        """Apply a newly announced seek (GRP-3) to the owned partitions, without a restart: what was
        decided before is written first (it happened before the seek), then each partition with the
        seek pending is claimed again and restarted at its target."""
        try:
            announced = self._owned.seek_announced()
            if announced == self._seek_seen or not self._flush():
                return
            restarted, fenced = self._owned.apply_seeks()
        except redis.RedisError as exc:
            _LOGGER.warning("%s: looking for seeks failed (%s); retrying", self.subscription, exc)
            return
        self._seek_seen = announced
        for partition in fenced:
            _LOGGER.warning("%s: partition %d fenced by a newer owner; dropping it", self.subscription, partition)
            self.drop(partition)
        for partition in restarted:
            self._writer.drop(partition)
            self._leases.drop_partition(partition)
        if restarted:
            self._last_commit = 0.0  # commit the targets at the next step: that completes the seek

    def _send_seeks(self) -> None:
        owned = self._owned
        if owned.seeks:
            for request in owned.seeks:
                self._fetcher.seek(request)
            owned.seeks.clear()

    def _write_started(self, now: float) -> None:
        """Queue the starts the workers noted, of deliveries still outstanding. Taken after the
        step's events: a worker notes a start before user code can settle the delivery, so a settle
        handled here comes before its start and the start is dropped (never written after SETTLED;
        a NACKED op marks the start itself), and a later redelivery's release is queued after it."""
        started = self._started
        if not started:
            return
        outstanding, writer, take = self._leases.outstanding, self._writer, started.popleft
        for _ in range(len(started)):
            delivery = take()
            record = delivery.record
            out = outstanding.get((record.partition, record.offset))
            if out is not None and out.delivery.token == delivery.token:
                writer.add(record.partition, (OpKind.STARTED, record.offset, delivery.attempt), now)

    def _settle(self, kind: int, delivery: Delivery, epoch: int, seconds: float, error: str | None,
                future: Future[AckResponse] | None, now: float) -> None:
        """Apply an ack, nack or deadline change of one delivery (the fields of a ``Settle``)."""
        record = delivery.record
        partition, offset = record.partition, record.offset
        state = self._partitions.get(partition)
        if state is None or state.epoch != epoch:
            resolve(future, AckResponse.LEASE_LOST)
            return
        key = (partition, offset)
        leases = self._leases
        out = leases.outstanding.get(key)
        if out is None or out.delivery.token != delivery.token:
            resolve(future, AckResponse.INVALID_ACK_ID)
            return
        writer = self._writer
        if kind == SettleKind.ACK:
            leases.acked(out, now)
            state.ack(delivery.queue_key, offset, delivery.token)
            writer.add(partition, (OpKind.SETTLED, offset, 0), now)
            self._counts["acked"] += 1
        elif kind == SettleKind.DEADLINE:
            writer.add(partition, (OpKind.LEASE, offset, leases.set_deadline(key, out, seconds, now)), now)
            writer.add_future(partition, future)
            return
        else:
            state.nack(delivery.queue_key, offset, delivery.token, now, self.settings.retry_policy.backoff)
            if error:
                record.last_error = error
            # A nack comes from user code: it marks the attempt started (its start note may have
            # been dropped with the nack in this step).
            writer.add(partition, (OpKind.NACKED, offset, delivery.attempt), now)
            self._counts["nacked"] += 1
        leases.pop(key)
        writer.add_future(partition, future)

    def _dead_lettered(self, event: DeadLettered, now: float) -> None:
        state = self._partitions.get(event.partition)
        if state is None or state.epoch != event.epoch:
            return
        out = self._leases.pop((event.partition, event.offset))
        if event.error is None:
            self._dead_letters.written += 1
            state.settle_dead_lettered(event.queue_key, event.offset)
            self._writer.add(event.partition, (OpKind.SETTLED, event.offset, 0), now)
        elif out is not None:
            state.requeue(event.queue_key, event.offset, out.delivery.token, now, _REQUEUE_DELAY)

    def _expire(self, now: float) -> None:
        """Leases: write the extensions (ACK-2); give back those that lapsed (ACK-1, SUB-4)."""
        extended, lapsed = self._leases.expire(now)
        writer = self._writer
        for extension in extended:
            writer.add(extension.partition, (OpKind.LEASE, extension.offset, extension.wall_ms), now)
        for out in lapsed:
            delivery = out.delivery
            partition, offset = delivery.record.partition, delivery.record.offset
            state = self._partitions.get(partition)
            if state is not None:
                _LOGGER.info("%s: lease of %d:%d lapsed; redelivering", self.subscription, partition, offset)
                state.nack(delivery.queue_key, offset, delivery.token, now, self.settings.retry_policy.backoff)
                writer.add(partition, (OpKind.NACKED, offset, 0), now)

    def _release(self, now: float) -> Released:
        """Release what may go out now, within flow control: callback mode one per key, pull mode
        whole per-key batches up to the waiting pull's size."""
        if self._closing:
            return []
        budget, byte_budget = self._gate.budget(len(self._leases.outstanding), self._leases.bytes)
        per_key = 1
        if self._on_messages is None:
            per_key = self._pulls.wanted()
            budget = min(budget, per_key)
        released = self._owned.release(now, budget, per_key, byte_budget)
        for state, batch in released:
            self._admit(state.partition, batch, now)
        return released

    def _admit(self, partition: int, batch: list[Delivery], now: float) -> None:
        """Released deliveries become outstanding; their attempts (and leases) are queued for Redis,
        flushed before anyone sees them (DLQ-3): as delivered for a pull, as released (in the pool,
        not yet started) in callback mode."""
        self._leases.admit(partition, batch, now)
        ops: list[Op] = []
        pooled = self._on_messages is not None
        kind: OpLetter = OpKind.RELEASED if pooled else OpKind.DELIVERED
        if self._leases.track:
            ops.append((OpKind.BATCH_LEASE, 0, wall_ms(self.settings.ack_deadline)))
            kind = OpKind.BATCH_RELEASED if pooled else OpKind.BATCH_DELIVERED
        ops.extend([(kind, d.record.offset, d.attempt) for d in batch])
        self._writer.extend(partition, ops, now)

    def _unrelease(self, released: Released, now: float) -> Released:
        """Redis did not take the attempt counts: give the deliveries back before anyone sees them (not a
        failure of theirs: their keys' backoff does not grow)."""
        for state, batch in released:
            for delivery in batch:
                record = delivery.record
                self._leases.pop((record.partition, record.offset))
                record.attempts -= 1
                state.requeue(delivery.queue_key, record.offset, delivery.token, now, _REQUEUE_DELAY)
        return []

    def _dispatch(self, released: Released) -> None:
        if not released:
            return
        messages: list[Message] = []
        partitions, topic, submit, dead_letters = self._partitions, self.topic, self._inbox.put, self._dead_letters
        screen = dead_letters.max_attempts is not None or bool(dead_letters.parked)
        redelivered = 0
        for state, batch in released:
            if partitions.get(state.partition) is not state:
                continue  # fenced by the flush that recorded these deliveries: the new owner has them
            epoch = state.epoch
            for delivery in batch:
                reason = dead_letters.verdict(delivery) if screen else None
                if reason is not None:
                    dead_letters.write(delivery, epoch, reason)
                    continue
                if delivery.attempt > 1:
                    redelivered += 1
                messages.append(Message(delivery, topic, epoch, submit))
        counts = self._counts
        counts["delivered"] += len(messages)
        counts["redelivered"] += redelivered
        if not messages:
            return
        if self._on_messages is not None:
            self._on_messages(messages)
        else:
            self._pulls.answer(messages)

    # -- Redis and Kafka commits ---------------------------------------------------------------------
    def _flush(self) -> bool:
        """Write queued ops of every owned partition in one round trip; False when Redis failed."""
        results = self._writer.flush({number: state.epoch for number, state in self._partitions.items()})
        if results is None:
            return False
        for partition, result in results.items():
            if result == ApplyResult.FENCED:
                _LOGGER.warning("%s: partition %d fenced by a newer owner; dropping it", self.subscription,
                                partition)
                self.drop(partition)
            elif result == ApplyResult.ADOPTED:
                self._owned.adopted(partition)
        return True

    def _offsets(self, *, sync: bool, only: list[int] | None = None) -> list[TopicPartition]:
        self._last_commit = time.monotonic()
        return self._owned.commit_offsets(self.topic, sync=sync, only=only)
