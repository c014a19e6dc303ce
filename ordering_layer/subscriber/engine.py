"""The engine: one coordinator over the subscriber's components, shared by every front end.

Two threads and one lock. The *fetch* thread (``Fetcher``) owns the Kafka consumer and tells the
coordinator of assignments, revocations and losses (``ownership``). The *engine* thread runs the
coordinator: it takes everything waiting in the inbox at once (fetched batches, acks, nacks,
deadline changes, pulls, commit and dead-letter reports) and in its ack queue (the lease handles of
plain acks, which ``Message.ack`` puts there without running Python), routes each typed request to
where its state is kept and applies the verdicts: partitions release what may go out (``OwnedPartition``: the
compiled core's key queues) within flow control (``FlowGate``), as outstanding leases (``LeaseTable``).
Attempts and leases reach Redis in one pipeline (``StateWriter``) *before* the messages are handed
out (``handoff``) or dead-lettered (``DeadLetters``); on a single Redis server the coordinator
writes the pipeline to its connection, one or two in flight (``Ownership``), and waits for the answer
in the same ``select`` as for its events; on a cluster a *sending* thread makes each round trip. The
answer wakes the coordinator, which meanwhile takes acks and releases more. After a step hands
messages out the coordinator lets the interpreter lock go once, so that user code starts on them at
once, and settles the plain acks made meanwhile before its release. Commits go back to the
fetch thread as queued requests. The components hold no references to each other; the rules live
in modules handed the components they act on: ``dispatch`` (release, hand-out), ``settlement``
(acks, nacks, deadlines, lapses, dead-letter reports, start notes), ``starts`` (attempt counts of
deliveries started, ACK-6, DLQ-3), ``commits`` (commit points and seeks, GRP-3), ``ownership``
(claims, revocations, flushes and their fencing verdicts) and ``moves`` (keys a growth moved, SUB-8).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from itertools import chain, groupby
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from ordering_layer._core import AckQueue
from ordering_layer.config import FlowControl, SubscriptionSettings
from ordering_layer.state import StateStore
from ordering_layer.state.counts import PartitionCounts
from ordering_layer.subscriber.client_config import consumer_settings
from ordering_layer.subscriber.commits import Commits
from ordering_layer.subscriber.dead_letters import DeadLetters
from ordering_layer.subscriber.dispatch import Dispatcher
from ordering_layer.subscriber.fetcher import Fetcher, RebalanceHooks
from ordering_layer.subscriber.flow import FlowGate, Gate
from ordering_layer.subscriber.flushes import Flushes
from ordering_layer.subscriber.handoff import PullWaiters
from ordering_layer.subscriber.inbox import Inbox
from ordering_layer.subscriber.leases import lease_table
from ordering_layer.subscriber.message import Message
from ordering_layer.subscriber.metrics import snapshot
from ordering_layer.subscriber.moves import MOVE_EVENTS, MoveGuard
from ordering_layer.subscriber.ownership import Ownership
from ordering_layer.subscriber.partitions import Partitions
from ordering_layer.subscriber.requests import Committed, DeadLettered, Fetched, GiveBack, Pull, Settle, Sought
from ordering_layer.subscriber.settlement import Settlement
from ordering_layer.subscriber.starts import Starts
from ordering_layer.subscriber.state_writer import StateWriter
from ordering_layer.worker import Worker, run_bounded

__all__ = ["Engine", "RebalanceHooks"]


_LOGGER = logging.getLogger(__name__)

LEAVE_TIMEOUT = 10.0  # seconds close waits for the last commit and the group leave


def known_partitions(store: StateStore, topic: str) -> int | None:
    """The topic's partition count as Redis last recorded it (``Engine``'s ``partitions``), None
    when it has none or did not answer."""
    return PartitionCounts(store.client, None).last_count(topic)


class Engine:
    """Ordered (or unordered) dispatch of one subscription at one subscriber.

    Args:
        kafka_config: confluent-kafka settings (passed through; group, commits and assignor are set).
        store: the Redis state store.
        subscription: subscription name (the Kafka consumer group).
        settings: the subscription's stored settings.
        flow_control: limits on outstanding messages and bytes (SUB-7).
        on_messages: callback mode: gets each released batch; None: pull mode (``pull`` releases).
        rebalance: user callbacks of assignments (after the claims), revocations (before the engine
            lets go) and losses, run on the fetch thread.
        watch: callback mode: called at each coordinator step with the time, returns when to be
            called again (None: next step); the pool wakes workers for waiting messages with it.
        track_leases: watch, extend and expire lease deadlines (ACK-1, ACK-2); off only for comparisons.
        partitions: the topic's partition count as last known (``PartitionCounts.last_count``),
            which sizes librdkafka's prefetch per partition (``client_config.prefetch_kbytes``);
            None: not known.
    """

    def __init__(self, kafka_config: Mapping[str, Any], store: StateStore, subscription: str,
                 settings: SubscriptionSettings, *, flow_control: FlowControl,
                 on_messages: Callable[[list[Message]], None] | None,
                 rebalance: RebalanceHooks | None = None, track_leases: bool = True,
                 watch: Callable[[float], float | None] | None = None, partitions: int | None = None) -> None:
        self.subscription = subscription
        self.settings = settings
        self.topic = settings.topic
        self.flow_control = flow_control
        self._on_messages = on_messages
        self._watch = watch
        self._watch_due: float | None = None
        self._inbox: Inbox[Any] = Inbox()
        # Plain acks that are the first request of their message: lease handles, no Python per ack.
        self._acks = AckQueue(self._inbox.nudge)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._gate = FlowGate(flow_control)
        self._leases = lease_table(settings, track=track_leases)
        self._writer = StateWriter(store, subscription, pipelined=store.pipelines)
        self._dead_letters = DeadLetters(kafka_config, store, subscription, settings, self._inbox.put)
        self._pulls = PullWaiters()
        self._moves = MoveGuard(kafka_config, store, subscription, self.topic, self._inbox.put)
        conf = consumer_settings(kafka_config, subscription, partitions)
        self._owned = Partitions(store, subscription, settings, suspects=on_messages is not None,
                                 submit=self._inbox.put, acks=self._acks, counts_for=self._moves.counts_for,
                                 departed_for=self._moves.departed_for)
        self._partitions = self._moves.owned = self._owned.owned
        self._closing = False
        self._counts = {"delivered": 0, "acked": 0, "nacked": 0, "redelivered": 0}
        self._settlement = Settlement(subscription, settings, self._partitions, self._leases, self._writer,
                                      self._counts)
        self._dispatcher = Dispatcher(settings, self._owned, self._gate, self._leases, self._writer, self._pulls,
                                      self._dead_letters, self._counts, on_messages, self._settlement.give_back)
        self._commits = Commits(self._owned, self.topic, subscription)
        self._flushes = Flushes(subscription, self._owned, self._leases, self._writer,
                                fenced=lambda partition: self._ownership.fenced(partition),
                                deliver=self._dispatcher.deliver, wake=self._inbox.nudge)
        self._ownership = Ownership(subscription, settings, self._changed, self._owned, self._leases, self._writer,
                                    self._commits, self._flushes, withdraw=self._dispatcher.withdraw)
        self._starts = Starts(subscription, settings, self._lock, store, self._owned, self._settlement,
                              self._ownership)
        self.notes_starts = self._starts.notes  # whether ``begin`` has anything to do for a non-suspect
        self._fetcher = Fetcher(conf, subscription, self.topic, self._gate, self._ownership, self._inbox.put,
                                rebalance or RebalanceHooks())
        self._worker = Worker(f"ordering-layer-engine-{subscription}", self._step)

    # -- public ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Join the group and start dispatching."""
        self._dead_letters.refresh_parked()
        self._moves.start()
        self._worker.start()
        self._fetcher.start()

    def close(self, timeout: float = 30.0) -> None:
        """Stop releasing, wait up to ``timeout`` for outstanding deliveries, commit, leave the group
        (the commit and the leave are waited for up to ``LEAVE_TIMEOUT``, then go on in the background)."""
        with self._lock:
            self._closing = True
            self._dispatcher.withdraw()  # released ahead of the pulls: no user code has them
            deadline = time.monotonic() + timeout
            while self._leases.count and time.monotonic() < deadline:
                self._changed.wait(0.05)
        self._fetcher.stop()
        self._worker.stop()
        with self._lock:
            now = time.monotonic()
            self._handle(self._inbox.take(), now)
            self._starts.note(self._pulls.take_served())
            self._settlement.write_starts(now)
            self._flushes.flush()
            self._pulls.close()
            offsets = self._commits.offsets(sync=True)
        self._flushes.close()
        self._moves.close()
        # The last commit and the group leave wait for the group coordinator with no timeout (45 s
        # with the broker down); the acks are in Redis (the floors), so they may end in the background.
        if not run_bounded(f"ordering-layer-leave-{self.subscription}", lambda: self._leave(offsets), LEAVE_TIMEOUT):
            _LOGGER.warning("%s: the group coordinator did not answer within %.0f s; the last commit and the group "
                            "leave go on in the background (the acked offsets are in Redis)", self.subscription,
                            LEAVE_TIMEOUT)
        self._dead_letters.close()

    def _leave(self, offsets: list[TopicPartition]) -> None:
        self._fetcher.commit_sync(offsets)
        with self._lock:
            self._handle(self._inbox.take(), time.monotonic())  # the commit's report: seeks it completes
        self._fetcher.close()

    def submit(self, request: Settle) -> None:
        """Post an ack, nack or deadline change (any thread)."""
        self._inbox.put(request)

    def give_back(self, messages: list[Message]) -> None:
        """Callback mode: a worker did not start these messages (the rest of a key's run)."""
        self._inbox.put(GiveBack(messages))

    def owns(self, message: Message) -> bool:
        """Callback mode: the message's partition is still owned under the epoch it was delivered in
        (read without the lock: a worker deciding whether to go on with a key's run)."""
        state = self._partitions.get(message.record.partition)
        return state is not None and state.epoch == message._epoch and not state.revoking

    def begin(self, message: Message) -> bool:
        """Callback mode: a worker is about to run user code on ``message`` (``Starts.begin``)."""
        return self._starts.begin(message)

    def pull(self, max_messages: int, timeout: float) -> list[Message]:
        """Release up to ``max_messages`` (at most one batch per key), waiting up to ``timeout`` s; added
        on this thread between the coordinator's steps (not to gather in the inbox), answered at once
        from the messages released ahead if any, and the coordinator woken to release more when
        the pull waits or the messages ready ahead run low."""
        pull = Pull(max_messages, time.monotonic() + timeout, Future())
        if not self._lock.acquire(timeout=max(timeout, 0.0)):
            self._inbox.put(pull)  # the lock was held all along: the coordinator expires it
            return pull.future.result(timeout + 30.0)
        try:
            if self._closing:
                pull.future.set_result([])
                refill = False
            else:
                self._dispatcher.pull(pull, time.monotonic())
                refill = self._pulls.refill()
        finally:
            self._lock.release()
        if refill:
            self._inbox.nudge()
        return pull.future.result(timeout + 30.0)

    @property
    def consumer(self) -> Consumer:
        """The Kafka consumer, for metadata queries only (librdkafka serves them from any thread)."""
        return self._fetcher.consumer

    @property
    def native_fetch(self) -> bool:
        """The records are fetched natively (``native_fetch``), not through ``consume()``."""
        return self._fetcher.native is not None

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
            return {"outstanding": self._leases.count, "outstanding_bytes": self._leases.bytes,
                    "buffered": self._owned.buffered(), "partitions": len(self._partitions),
                    "fetch_held": int(self._gate.state is not Gate.OPEN),
                    "fetch_paused": int(self._gate.state is Gate.PAUSED)}

    def metrics_snapshot(self) -> dict[str, Any]:
        """Counters, gauges and the observations since the previous call (see ``metrics.snapshot``)."""
        with self._lock:
            return snapshot(self._counts, self._partitions, self._leases, self._writer, now=time.monotonic(),
                            dead_lettered=self._dead_letters.written, malformed=self._fetcher.malformed_records)

    # -- engine thread ---------------------------------------------------------------------------
    def _step(self) -> float:
        inbox = self._inbox
        # A step takes what is there: batches (one Redis round trip for many messages, ACK-4) form
        # from the events that came while the last step and its flush ran, never from waiting.
        if self._acks.arm():  # no ack waiting: sleep until one comes, an event, a due time or an answer
            with self._lock:
                wait, answer = self._wait_time(time.monotonic()), self._flushes.answer_socket()
            inbox.wait(1, wait, answer)
            self._acks.disarm()
        events = inbox.take()
        with self._lock:
            now = time.monotonic()
            self._handle(events, now)
            self._settlement.write_starts(now)
            self._settlement.expire(now)
            flushes, dispatcher, delivered = self._flushes, self._dispatcher, self._counts["delivered"]
            flushes.poll()
            if self._counts["delivered"] > delivered:  # the answers handed messages out
                # Let the callback workers (or the pulling threads) have the interpreter lock now
                # rather than at the coordinator's next wait: user code starts on what the answers
                # just handed out, and the acks it makes meanwhile are settled before the release
                # below, which so has their budget. Posted after this step's events were taken, each
                # ack is still ahead of any later request about its message (in the inbox, for the
                # next step). Under flow control the time a message stays outstanding bounds
                # throughput (measured: ``bench/RESULTS.md``). A thread that needs the coordinator's
                # lock waits for it, and the interpreter comes back at once.
                time.sleep(0)
                now = time.monotonic()
                self._settlement.acks_queued(self._acks, now)
            if not self._closing:
                flushes.hold(dispatcher.release(now))
            else:
                dispatcher.withdraw()
            self._dead_letters.poll()
            flushes.start(now)
            self._pulls.expire(now)
            commits = self._commits
            if commits.due(now):
                offsets = commits.offsets(sync=False)
                if offsets:
                    self._fetcher.commit(offsets)
                self._dead_letters.refresh_parked()
                self._ownership.apply_seeks()
            for request in commits.take_seeks():
                self._fetcher.seek(request)
            if self._watch is not None:
                self._watch_due = self._watch(now)
            leases, gate, buffered = self._leases, self._gate, self._owned.buffered()
            gate.update(leases.count, leases.bytes, buffered, now, self._owned.ready())
            if gate.state is not Gate.OPEN or gate.ample or gate.short:
                gate.update_short({number: state.buffered for number, state in self._partitions.items()
                                   if not state.revoking})
            if gate.state is not Gate.OPEN and buffered >= gate.buffer_limit() * gate.resume_fraction:
                self._owned.end_walks()
            self._starts.note(self._pulls.take_served())
            self._changed.notify_all()
        return 0.0

    def _wait_time(self, now: float) -> float:
        times = [self._flushes.next_due(), self._leases.next_check(), self._pulls.next_deadline(), self._watch_due,
                 *(state.next_wake() for state in self._partitions.values())]
        return min([0.1, *(max(0.0, t - now) for t in times if t is not None)])

    def _handle(self, events: list[Any], now: float) -> None:
        # The ack queue is taken after the inbox's ``events`` and applied before them: an ack queued
        # is its message's first request, posted before any request about the same message in them.
        self._settlement.acks_queued(self._acks, now)
        settle, acks = self._settlement.settle, self._settlement.acks
        for kind, group in groupby(events, type):  # plain acks in a row are applied in one pass
            if kind is Message:
                acks(list(group), now)
            elif kind is list:  # plain acks of a batch (``message.ack_all``)
                acks(list(chain.from_iterable(group)), now)
            elif kind is Settle:
                for event in group:
                    settle(event.kind, event.delivery, event.epoch, event.seconds, event.error, event.future, now)
            else:
                for event in group:
                    self._route(kind, event, now)

    def _route(self, kind: type, event: Any, now: float) -> None:  # an event that is not a settlement
        if kind is Fetched:
            self._moves.take(event, self._owned.take)
            self._gate.taken(len(event.records))
        elif kind in MOVE_EVENTS:
            self._moves.route(event)
        elif kind is Pull:
            if self._closing:
                event.future.set_result([])
            else:
                self._dispatcher.pull(event, now)
        elif kind is GiveBack:
            self._dispatcher.give_back(event.messages, now)
        elif kind is Committed:
            self._commits.committed(event, now)
        elif kind is Sought:
            self._owned.sought(event.partition, event.generation, event.seek_generation)
        elif kind is DeadLettered and self._settlement.dead_lettered(event, now):
            self._dead_letters.written += 1
