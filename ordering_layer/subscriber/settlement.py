"""What becomes of outstanding deliveries: acks, nacks, deadline changes, lapses, dead-letter reports.

``Settlement`` applies each answer about a delivery handed out to the three places that keep its
state: its partition's key queue (``OwnedPartition``'s core: settle, or rewind and back off, SUB-4
and DLQ-1), its lease (``LeaseTable``: forgotten, or a new deadline, ACK-1 to ACK-3) and the Redis ops
queued for the next flush (``StateWriter``: SETTLED, NACKED, LEASE, STARTED, ACK-4). An answer
under an epoch that is no longer the partition's, or for a delivery given back since, changes
nothing; its ``ack_with_response`` future learns why (ACK-5). Used by the coordinator on its
thread, under its lock; it decides nothing about ownership.

Attempt counts (ACK-6, DLQ-3): in callback mode the workers note when user code starts on a
delivery (``starts``, appended without a lock), in pull mode the coordinator notes the messages a
pull took from those released ahead of it; the notes are written with the next flush, after the
step's settles, so that a start is never written after its delivery's settle.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future

from ordering_layer._core import AckQueue
from ordering_layer.config import SubscriptionSettings
from ordering_layer.state.store import OpKind
from ordering_layer.subscriber.leases import LeaseTable
from ordering_layer.subscriber.message import AckResponse, Message
from ordering_layer.subscriber.owned_partition import OwnedPartition
from ordering_layer.subscriber.records import Delivery
from ordering_layer.subscriber.requests import DeadLettered, SettleKind
from ordering_layer.subscriber.state_writer import StateWriter, resolve

_LOGGER = logging.getLogger(__name__)

REQUEUE_DELAY = 1.0  # after a failed Redis or dead-letter write: the write is retried, no failure counted


class Settlement:
    """Answers about outstanding deliveries, applied to key queues, leases and queued ops.

    Args:
        subscription: subscription name (for logs).
        settings: the subscription's settings (the retry policy's backoff).
        owned: the owned partitions' states (the coordinator's live mapping).
        leases: the outstanding deliveries.
        writer: the queued Redis ops.
        counts: the engine's counters (``acked``, ``nacked`` are bumped here).
    """

    def __init__(self, subscription: str, settings: SubscriptionSettings, owned: Mapping[int, OwnedPartition],
                 leases: LeaseTable, writer: StateWriter, counts: dict[str, int]) -> None:
        self._subscription = subscription
        self._settings = settings
        self._owned = owned
        self._leases = leases
        self._writer = writer
        self._counts = counts
        # Callback mode: deliveries whose user code started, noted by the workers (deque appends
        # and pops are thread-safe: the hot path takes no lock).
        self.starts: deque[Delivery] = deque()

    def settle(self, kind: int, delivery: Delivery, epoch: int, seconds: float, error: str | None,
               future: Future[AckResponse] | None, now: float) -> None:
        """Apply an ack, nack or deadline change of one delivery (the fields of a ``Settle``)."""
        record = delivery.record
        partition, offset = record.partition, record.offset
        state = self._owned.get(partition)
        if state is None or state.epoch != epoch:
            resolve(future, AckResponse.LEASE_LOST)
            return
        leases = self._leases
        if not leases.holds(delivery.lease):
            resolve(future, AckResponse.INVALID_ACK_ID)
            return
        writer = self._writer
        if kind == SettleKind.ACK:
            leases.pop(delivery.lease, now)
            state.core.ack_one(offset, delivery.token)
            writer.queued(1, now)
            self._counts["acked"] += 1
        elif kind == SettleKind.DEADLINE:
            deadline = leases.set_deadline(delivery.lease, seconds, now)
            assert deadline is not None  # held, checked above
            writer.push(state, OpKind.LEASE, offset, deadline, now)
            writer.add_future(partition, future)
            return
        else:
            # A nack comes from user code: its NACKED op carries the attempt, which marks it started
            # (its start note may have been dropped with the nack in this step).
            leases.pop(delivery.lease)
            state.nack(delivery, now, self._settings.retry_policy.backoff)
            writer.queued(1, now)
            if error:
                record.last_error = error
            self._counts["nacked"] += 1
        writer.add_future(partition, future)

    def acks(self, messages: list[Message], now: float) -> None:
        """Apply plain acks (``Message.ack``: no future to answer), in order: ``settle`` of ACK for a
        run of them, in one call to the lease table (no Python per message). An ack under an epoch
        that is no longer the partition's, or of a message that is not the delivery outstanding
        (given back since), changes nothing."""
        self._acked(self._leases.ack_run(messages, self._owned, now), now)

    def acks_queued(self, queue: AckQueue, now: float) -> None:
        """Apply the plain acks waiting in ``queue`` (first requests of messages, ``Message.ack``) as
        ``acks`` does. Taken before the inbox's events of the same step: a request made after an ack
        of the same message went through the inbox, so it is applied after the ack."""
        if len(queue):
            self._acked(self._leases.ack_queued(queue, self._owned, now), now)

    def _acked(self, acked: int, now: float) -> None:
        if acked:
            self._writer.queued(acked, now)
            self._counts["acked"] += acked

    def write_starts(self, now: float) -> None:
        """Queue the starts the workers noted, of deliveries still outstanding. Taken after the
        step's events: a worker notes a start before user code can settle the delivery, so a settle
        handled here comes before its start and the start is dropped (never written after SETTLED;
        a NACKED op marks the start itself), and a later redelivery's release is queued after it."""
        started = self.starts
        if not started:
            return
        notes = [started.popleft() for _ in range(len(started))]
        self._writer.queued(self._leases.write_starts(notes, self._owned, OpKind.STARTED), now)

    def expire(self, now: float) -> None:
        """Leases: write the extensions (ACK-2); give back those that lapsed (ACK-1, SUB-4)."""
        extended, lapsed = self._leases.expire(now)
        writer, owned = self._writer, self._owned
        for partition, offset, wall_ms in extended:
            state = owned.get(partition)
            if state is not None:
                writer.push(state, OpKind.LEASE, offset, wall_ms, now)
        for partition, offset, token in lapsed:
            state = owned.get(partition)
            if state is not None:
                _LOGGER.info("%s: lease of %d:%d lapsed; redelivering", self._subscription, partition, offset)
                state.core.nack(offset, token, now, self._settings.retry_policy.backoff, lapsed=True)
                writer.queued(1, now)

    def dead_lettered(self, event: DeadLettered, now: float) -> bool:
        """The dead-letter topic's answer about a delivery (DLQ-2): settled when it took the record,
        given back without a failure when it refused it. True when a dead letter was written."""
        state = self._owned.get(event.partition)
        if state is None or state.epoch != event.epoch:
            return False
        leases = self._leases
        handle = leases.find(event.partition, event.offset)
        lease = None if handle is None else leases.lease_of(handle)
        if handle is not None:
            leases.pop(handle)
        if event.error is None:
            state.settle_dead_lettered(event.queue_key, event.offset)
            self._writer.queued(1, now)
            return True
        if lease is not None:
            state.core.requeue(event.offset, lease[3], now, REQUEUE_DELAY)
        return False

    def holds(self, delivery: Delivery, epoch: int) -> bool:
        """The delivery is still outstanding here under ``epoch`` (not given back, not moved)."""
        state = self._owned.get(delivery.record.partition)
        return state is not None and state.epoch == epoch and self._leases.holds(delivery.lease)

    def give_back(self, released: Iterable[tuple[OwnedPartition, Sequence[Delivery]]], now: float,
                  delay: float = REQUEUE_DELAY) -> None:
        """Give released deliveries back before anyone sees them: Redis did not take their attempt
        counts (their keys are held ``delay`` s before the write is tried again), or they were
        released ahead of pulls that did not take them (``delay`` 0). Not a failure of theirs: their
        keys' backoff does not grow, the attempt is taken back."""
        for state, batch in released:
            for delivery in batch:
                self._leases.pop(delivery.lease)
                state.requeue(delivery, now, delay, uncount=True)
