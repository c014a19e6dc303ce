"""Per-partition dispatch state: routing to per-key hold queues, release, cascade bookkeeping.

Pure logic, no I/O: the pure-Python reference of the compiled core the engine runs
(``owned_partition``, ``core/src/partition.rs``); ``tests/model/test_core.py`` drives both with the
same operations and checks they agree. ``PartitionState`` routes records to key queues
(``key_queue.KeyQueue``), runs the recovery walk after a claim (``recovery_walk.RecoveryWalk``; its
ops and the rewinds' ``UNSETTLED`` are listed in ``cascade_ops``), releases what may go out, rewinds
a key's cursor on a nack or lapse (SUB-4) and holds the key back (``key_queue.KeyBackoff``, DLQ-1),
and lets quarantined suspects out one at a time (``key_queue.Quarantine``, DLQ-3); its commit point
is kept by ``commit_point.OffsetTracker``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from ordering_layer.subscriber.records import AWAITING_SEEK
from tests.model.commit_point import OffsetTracker
from tests.model.key_queue import (
    QUARANTINE_FROM,
    Delivery,
    KeyBackoff,
    KeyQueue,
    Quarantine,
    QueueKey,
    Record,
)
from tests.model.recovery_walk import RecoveryWalk

__all__ = ["AWAITING_SEEK", "Delivery", "PartitionState", "QueueKey", "Record"]


_tokens = itertools.count(1)



class PartitionState:
    """Dispatch state of one owned partition.

    Args:
        partition: partition number.
        epoch: owner epoch from the claim (ACK-5).
        ordered: ordering enabled on the subscription (SUB-1 vs SUB-6).
        settled_before: offsets settled above the committed offset, read at claim (recovery walk).
        attempts_before: delivery attempts charged to unsettled records handed out by earlier owners
            (ACK-6, see ``partitions.charged_attempts``); those records are suspects when ``suspects``.
        suspects: callback mode. A suspect's every start is written before user code runs, and the
            suspects charged ``QUARANTINE_FROM`` attempts or more go out one at a time
            (``Quarantine``). Pull mode has none: a pull hands a batch to user code at once, which
            may hold it while it pulls again, so a quarantine would stall it.
        generation: the assignment generation it was claimed under: only records fetched under it
            belong to it (``AWAITING_SEEK``: none, until the consumer has sought to ``start_offset``).
        start_offset: where a seek (GRP-3) restarted the partition; None: at the committed offset.
        seek_generation: the partition's latest seek applied (0: none); its commits carry it.
        cascades: the marks of an earlier owner whose walk was ended early: the key of each
            mark's record cascades from it (SUB-4).
        floor: the floor read at claim (``OpKind.FLOOR``): the records below it were settled before
            and are skipped. None: no floor was kept.
    """

    def __init__(self, partition: int, epoch: int, *, ordered: bool,
                 settled_before: frozenset[int] = frozenset(),
                 attempts_before: dict[int, int] | None = None, suspects: bool = True, generation: int = 0,
                 start_offset: int | None = None, seek_generation: int = 0,
                 cascades: frozenset[int] = frozenset(), floor: int | None = None) -> None:
        self.partition = partition
        self.epoch = epoch
        self.generation = generation
        self.seek_generation = seek_generation
        self.start_offset = start_offset
        self.ordered = ordered
        self.tracker = OffsetTracker()
        # After a seek the commit point is the target until records arrive (a purge may bring none).
        self.tracker.next_offset = start_offset
        self.keys: dict[QueueKey, KeyQueue] = {}
        self.ready: dict[QueueKey, None] = {}
        self._backoff = KeyBackoff()
        self.backing_off = self._backoff.held  # read per message: the dict itself, not the holder
        self.buffered = 0
        self.revoking = False
        # The cascade's ops in order: ("u", offset) a settled record goes out again (UNSETTLED),
        # ("c", offset) a key cascades from offset (CASCADE_FROM), ("x", offset) a mark is dropped.
        self.cascade_ops: list[tuple[str, int]] = []
        self._walk = RecoveryWalk(settled_before, cascades, self.cascade_ops)
        self._floor = -1 if floor is None else floor
        self._attempts_before = dict(attempts_before or {})
        self._suspects = suspects
        self.quarantine = Quarantine()

    # -- intake ----------------------------------------------------------------------------------
    def queue_key(self, record: Record) -> QueueKey:
        """Ordered subscriptions queue by ordering key; unordered records queue alone."""
        key = record.key
        if self.ordered and key:
            return key
        return record.offset

    def add(self, record: Record) -> bool:
        """Take a fetched record; False when it is skipped (a duplicate, or settled before a crash)."""
        next_offset = self.tracker.next_offset
        if next_offset is not None and record.offset < next_offset:
            return False
        self.tracker.add(record.offset)
        if record.offset < self._floor:
            self.tracker.settle(record.offset)
            self._walk.passed(record.offset)
            return False
        qkey = self.queue_key(record)
        if not self._walk.take(record.offset, qkey):
            self.tracker.settle(record.offset)
            return False
        before = self._attempts_before
        if before:
            attempts = before.pop(record.offset, None)
            if attempts is not None:
                record.attempts = attempts
                record.suspect = self._suspects
                record.quarantined = self._suspects and attempts >= QUARANTINE_FROM
        queue = self.keys.get(qkey)
        if queue is None:
            queue = self.keys[qkey] = KeyQueue()
        queue.records.append(record)
        self.buffered += 1
        if not queue.outstanding and qkey not in self.backing_off:
            self.ready[qkey] = None
        return True

    @property
    def watermark(self) -> int | None:
        """The commit point: the lowest unsettled offset, held at the lowest cascade mark."""
        return self._walk.hold(self.tracker.watermark)

    @property
    def walking(self) -> bool:
        """The recovery walk holds releases: not every record settled before was taken yet."""
        return self._walk.holding

    def end_walk(self) -> None:
        """Release during the walk from now on (``RecoveryWalk.end_early``)."""
        self._walk.end_early()

    # -- release ---------------------------------------------------------------------------------
    def release(self, qkey: QueueKey, now: float, limit: int) -> list[Delivery]:
        """Release up to ``limit`` records of one key (callback mode: 1; pull mode: a batch); a
        quarantined record goes out alone, once no other of the partition is out (``Quarantine``)."""
        queue = self.keys.get(qkey)
        if queue is None or not queue.releasable(now):
            return []
        cursor = queue.cursor
        records = queue.records
        head = records[cursor]
        if head.quarantined:
            if not self.quarantine.admit(qkey, head.offset):
                return []
            limit = 1
        batch = [head] if limit == 1 else list(itertools.islice(records, cursor, cursor + limit))
        deliveries: list[Delivery] = []
        outstanding = queue.outstanding
        for record in batch:
            if record.quarantined and deliveries:
                break
            token = next(_tokens)
            outstanding[record.offset] = token
            record.attempts += 1
            deliveries.append(Delivery(record, qkey, token, record.attempts))
        queue.cursor = cursor + len(deliveries)
        self.buffered -= len(deliveries)
        return deliveries

    def release_ready(self, now: float, budget: int, per_key: int, byte_budget: int) -> list[Delivery]:
        """Release from the ready keys, oldest first: up to ``per_key`` records of each, ``budget``
        records in all, and no further key once ``byte_budget`` payload bytes are used up. The keys
        looked at leave the ready set (an ack, a nack or the end of a backoff brings them back)."""
        if self.walking:
            return []
        released: list[Delivery] = []
        ready = self.ready
        for qkey in list(itertools.islice(ready, budget)):
            if budget <= 0 or byte_budget <= 0:
                break
            del ready[qkey]
            batch = self.release(qkey, now, min(per_key, budget))
            for delivery in batch:
                byte_budget -= delivery.record.size
            released.extend(batch)
            budget -= len(batch)
        return released

    # -- settlement ------------------------------------------------------------------------------
    def ack(self, qkey: QueueKey, offset: int, token: int) -> bool:
        """Settle a delivery; False when the token is stale (redelivered since, or never issued)."""
        queue = self.keys.get(qkey)
        if queue is None or queue.outstanding.get(offset) != token:
            return False
        del queue.outstanding[offset]
        queue.acked.add(offset)
        queue.failures = 0
        self.tracker.settle(offset)
        self._pop_settled(qkey, queue, offset)
        return True

    def settle_dead_lettered(self, qkey: QueueKey, offset: int) -> None:
        """Settle a delivered record without an ack (dead-lettered: DLQ-2); one waiting to go out again
        (a rewind passed it while its dead letter was being written) leaves its queue."""
        queue = self.keys.get(qkey)
        if queue is not None:
            index = next((i for i, r in enumerate(queue.records) if r.offset == offset), -1)
            if offset not in queue.outstanding and index >= queue.cursor:
                del queue.records[index]
                self.buffered -= 1
            else:
                queue.outstanding.pop(offset, None)
                queue.acked.add(offset)
            self.tracker.settle(offset)
            self._pop_settled(qkey, queue, offset)

    def _pop_settled(self, qkey: QueueKey, queue: KeyQueue, offset: int) -> None:
        quarantine = self.quarantine
        if offset == quarantine.offset:
            quarantine.settled(self.ready)
        records, acked = queue.records, queue.acked
        while queue.cursor > 0 and records and records[0].offset in acked and records[0].offset not in \
                queue.outstanding:
            acked.discard(records.popleft().offset)
            queue.cursor -= 1
        if not records:
            del self.keys[qkey]
            self.ready.pop(qkey, None)
            self.backing_off.pop(qkey, None)  # KeyBackoff.cancel, inlined: it runs per ack
            quarantine.waiting.pop(qkey, None)  # a key with nothing left to send waits for nothing
        elif not queue.outstanding and qkey not in self.backing_off:
            self.ready[qkey] = None

    def nack(self, qkey: QueueKey, offset: int, token: int, now: float,
             backoff: Callable[[int], float]) -> bool:
        """Give a delivery back (nack or lapsed lease): rewind its key to it (SUB-4) and back off
        the key (DLQ-1), the longer the more failures in a row. False when the token is stale."""
        queue = self._rewind(qkey, offset, token)
        if queue is None:
            return False
        queue.failures += 1
        self._hold(qkey, queue, now, backoff(queue.failures))
        return True

    def requeue(self, qkey: QueueKey, offset: int, token: int, now: float, delay: float) -> bool:
        """Give a delivery back because the layer failed (a Redis or dead-letter write), not the
        message: rewind its key as ``nack`` does and hold it ``delay`` seconds, without counting a
        failure (the key's backoff does not grow). False when the token is stale."""
        queue = self._rewind(qkey, offset, token)
        if queue is None:
            return False
        self._hold(qkey, queue, now, delay)
        return True

    def _rewind(self, qkey: QueueKey, offset: int, token: int) -> KeyQueue | None:
        queue = self.keys.get(qkey)
        if queue is None or queue.outstanding.get(offset) != token:
            return None
        index = next(i for i, r in enumerate(queue.records) if r.offset == offset)
        for record in itertools.islice(queue.records, index, queue.cursor):
            if queue.outstanding.pop(record.offset, None) is not None and self._suspects and record.offset != offset:
                record.attempts -= 1  # callback mode: released after the rewound one, never started
            if record.offset in queue.acked:
                queue.acked.discard(record.offset)
                self.tracker.unsettle(record.offset)
                self.cascade_ops.append(("u", record.offset))
        self.buffered += queue.cursor - index
        queue.cursor = index
        if offset == self.quarantine.offset:  # it went out alone: its key has no other outstanding
            self.quarantine.settled(self.ready)
        return queue

    def _hold(self, qkey: QueueKey, queue: KeyQueue, now: float, delay: float) -> None:
        queue.not_before = now + delay
        if delay > 0:
            self._backoff.hold(qkey, queue.not_before)
            self.ready.pop(qkey, None)
            return
        self._backoff.cancel(qkey)
        if not queue.outstanding:
            self.ready[qkey] = None

    def wake(self, now: float) -> None:
        """Move keys whose backoff has ended back to the ready set (due-time order, no scan)."""
        keys = self.keys
        for qkey in self._backoff.ended(now):
            queue = keys.get(qkey)
            if queue is not None and not queue.outstanding:
                self.ready[qkey] = None

    def next_wake(self) -> float | None:
        """The earliest end of a backoff, if any key is backing off."""
        return self._backoff.next_end()

    def held_keys(self) -> int:
        """Keys with something outstanding or backing off (a scan: for metrics, not the hot path)."""
        backing_off = self.backing_off
        return sum(1 for qkey, queue in self.keys.items() if queue.outstanding or qkey in backing_off)
