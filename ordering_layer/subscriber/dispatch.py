"""Release and hand-out: what may go out now, made outstanding, then handed to user code.

``release`` takes from the partitions' ready keys within flow control (``FlowGate``: SUB-7): in
callback mode one per key, or when few keys are ready a run of a key's records that one worker
starts one after another, each once the one before it is acked (SUB-1, ``CallbackPool``); whole
per-key batches up to the waiting pull's size in pull
mode, and when no pull waits, up to the latest pull's size ahead of the next one (``PullWaiters``:
a pull finds its messages ready); each released batch becomes outstanding (the ``LeaseTable``) and
its attempts are queued for Redis (``StateWriter``). The coordinator flushes those ops *before*
``hand_out`` (ACK-6, DLQ-3): a message no attempt of which Redis has taken never reaches user code.
``hand_out`` screens each delivery for dead-lettering (``DeadLetters``: DLQ-2, DLQ-3) and hands the
rest to the callback pool, the pull the release was for, or the messages ready for the next pulls
(``handoff``). Used under the engine's lock: by the coordinator, and by a pulling thread for its
own pull (``Engine.pull``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

from ordering_layer._core import redeliveries
from ordering_layer.config import SubscriptionSettings
from ordering_layer.subscriber.dead_letters import DeadLetters
from ordering_layer.subscriber.flow import FlowGate
from ordering_layer.subscriber.handoff import PullWaiters
from ordering_layer.subscriber.leases import LeaseTable, wall_ms
from ordering_layer.subscriber.message import Message
from ordering_layer.subscriber.partitions import Partitions, Released
from ordering_layer.subscriber.requests import Pull
from ordering_layer.subscriber.runs import RUN_MAX
from ordering_layer.subscriber.settlement import REQUEUE_DELAY
from ordering_layer.subscriber.state_writer import StateWriter


class Dispatcher:
    """The release and hand-out of one engine (under the engine's lock).

    Args:
        settings: the subscription's settings (the ack deadline of a new lease).
        owned: the owned partitions.
        gate: flow control, giving the release budget.
        leases: the outstanding deliveries.
        writer: the queued Redis ops.
        pulls: the waiting pulls (pull mode).
        dead_letters: the dead-letter screen and writer.
        counts: the engine's counters (``delivered``, ``redelivered`` are bumped here).
        on_messages: callback mode: receives each handed-out batch; None for pull mode.
        give_back: takes released deliveries back unseen, their keys held the given seconds
            (``Settlement.give_back``).
    """

    def __init__(self, settings: SubscriptionSettings, owned: Partitions, gate: FlowGate,
                 leases: LeaseTable, writer: StateWriter, pulls: PullWaiters, dead_letters: DeadLetters,
                 counts: dict[str, int], on_messages: Callable[[list[Message]], None] | None,
                 give_back: Callable[[Released, float, float], None]) -> None:
        self._settings = settings
        self._owned = owned
        self._gate = gate
        self._leases = leases
        self._writer = writer
        self._pulls = pulls
        self._dead_letters = dead_letters
        self._counts = counts
        self._on_messages = on_messages
        self._give_back = give_back

    def release(self, now: float) -> Released:
        """Release what may go out now, within flow control: callback mode one per key, pull mode
        whole per-key batches up to the waiting pull's size, or ahead of the next pull."""
        leases = self._leases
        budget, byte_budget = self._gate.budget(leases.count, leases.bytes)
        per_key, pooled, ahead, run_share = 1, True, False, 0.0
        if self._on_messages is not None:
            # Few keys at work (a hot key): a key's run of records goes to one worker, which starts
            # each as soon as the one before it is acked (``runs``); many keys: one record each. A
            # key's share is of the whole flow-control limit over the keys ready or outstanding, so
            # that a key whose run ended gets a run again while the others hold their shares. A key
            # far behind the others (skewed keys: its records are much of those buffered) may take
            # as much of the limit as its part of the buffered records: it holds the partition's
            # commit point back, and each record of it takes a step and a Redis round trip.
            owned = self._owned
            keys = owned.ready() + owned.busy()
            limit = self._gate.limits.max_messages
            per_key = max(1, min(RUN_MAX, limit // max(1, keys)))
            run_share = limit / max(1, owned.buffered())
        else:
            wanted, for_pull = self._pulls.wanted()
            budget, per_key = min(budget, wanted), self._pulls.per_key()
            pooled = ahead = not for_pull
        lease_ms = wall_ms(self._settings.ack_deadline) if leases.track else None
        # Released deliveries become outstanding in the lease table, watched together; the
        # partition's core queued their attempts for Redis, flushed before anyone sees them (DLQ-3):
        # as delivered for a waiting pull, as released (not yet started) in callback mode and ahead
        # of the pulls. Their lease (``lease_ms``) is written by a later flush if they are still
        # outstanding then.
        released = self._owned.release(now, budget, per_key, byte_budget, lease_ms, pooled=pooled, leases=leases,
                                       ahead=ahead, run_share=run_share, run_most=RUN_MAX)
        if released and self._on_messages is None:
            self._pulls.claim(sum(len(batch) for _, batch in released), not ahead)
        writer = self._writer
        for _, batch in released:
            writer.queued(len(batch), now)
        return released

    def pull(self, pull: Pull, now: float) -> None:
        """A pull arrived: answered at once from the messages released ahead, if any."""
        self._give_back_messages(self._pulls.add(pull, self._leases), now)

    def withdraw(self, partitions: Collection[int] | None = None) -> None:
        """Give back the messages released ahead of the pulls, of ``partitions`` (None: all): they are
        being revoked, or the engine is closing."""
        self._give_back_messages(self._pulls.withdraw(partitions), time.monotonic())

    def give_back(self, messages: list[Message], now: float) -> None:
        """Messages a callback worker did not start go back to their keys, uncounted, and out of the
        delivered (and redelivered) counts: user code never had them (a nack's rewind may have taken
        them back already)."""
        counts = self._counts
        counts["delivered"] -= len(messages)
        counts["redelivered"] -= redeliveries(messages)
        self._give_back_messages(messages, now)

    def _give_back_messages(self, messages: list[Message], now: float) -> None:
        if not messages:
            return
        by_partition: dict[int, list[Message]] = {}
        for message in reversed(messages):  # a key's last first: each is rewound to alone, uncounted
            by_partition.setdefault(message.record.partition, []).append(message)
        owned = self._owned.owned
        self._give_back([(owned[number], batch) for number, batch in by_partition.items() if number in owned], now,
                        0.0)

    def hand_out(self, released: Released) -> None:
        """Hand released deliveries, their attempts written, to user code (one release's batches:
        the pull it claimed gets them); dead-letter those the policy says (their write's report
        settles them later)."""
        if not released:
            return
        messages: list[Message] = []
        partitions, dead_letters = self._owned.owned, self._dead_letters
        screen = dead_letters.max_attempts is not None or bool(dead_letters.parked)
        redelivered = 0
        for state, batch in released:
            if partitions.get(state.partition) is not state:
                continue  # fenced by the flush that recorded these deliveries: the new owner has them
            if not screen:
                messages.extend(batch)
                redelivered += redeliveries(batch)
                continue
            epoch = state.epoch
            for message in batch:
                reason = dead_letters.verdict(message)
                if reason is not None:
                    dead_letters.write(message, epoch, reason)
                    continue
                if message.attempt > 1:
                    redelivered += 1
                messages.append(message)
        counts = self._counts
        counts["delivered"] += len(messages)
        counts["redelivered"] += redelivered
        if self._on_messages is None:
            self._give_back_messages(self._pulls.answer(messages, self._leases), time.monotonic())
        elif messages:
            self._on_messages(messages)

    def deliver(self, released: Released, written: bool) -> None:
        """One release's deliveries whose flush answered: handed out when Redis took their attempts,
        given back unseen otherwise (their attempts not counted; in pull mode its pull waits again)."""
        if written:
            self.hand_out(released)
            return
        self._give_back(released, time.monotonic(), REQUEUE_DELAY)
        if self._on_messages is None:
            self._pulls.unclaim()
