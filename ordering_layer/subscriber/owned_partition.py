"""One partition the engine owns: its ownership fields around the compiled dispatch core.

The per-message bookkeeping of a partition (key queues, the recovery walk, release, cascade
rewinds, backoff, the quarantine of suspects, the commit point, and the Redis ops those decisions
make) runs in ``ordering_layer._core.PartitionCore`` (``core/``), which keeps ``PartitionState``'s
semantics: ``PartitionState`` (``tests/model/partition.py``) is the pure-Python reference it is
tested against (``tests/model/test_core.py``). What stays here is what the engine knows about the
ownership: the owner epoch (ACK-5), the assignment generation records must be fetched under
(SUB-3), the seek the partition was restarted by (GRP-3), and whether it is being revoked (SUB-5).

Every state op of the partition is queued in the core, in decision order: the core queues those of
its own decisions (``RELEASED``/``DELIVERED`` with the batch lease, ``SETTLED``, ``NACKED``), the
coordinator those it decides itself (``STARTED``, ``LEASE``) with ``push_op``; ``StateWriter`` takes
them packed for ``apply.lua``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ordering_layer._core import AckQueue, Deliveries, LeaseTable, PartitionCore
from ordering_layer.state.store import OpLetter
from ordering_layer.subscriber.message import Message, unattached
from ordering_layer.subscriber.records import Delivery, QueueKey, Record

__all__ = ["OwnedPartition"]


class OwnedPartition:
    """An owned partition: ownership fields and the core holding its records.

    Args: those of ``PartitionState`` (partition, epoch, ordering, the claim's settled offsets,
    charged attempts, cascade marks and floor, suspects, generation, seek), and:
        topic: the topic, named in each ``Message``.
        submit: where a released ``Message`` posts its requests (the engine's inbox).
        acks: where a released ``Message`` puts a first plain ack (the engine's ``AckQueue``; without
            one, acks go to ``submit`` too).
    """

    __slots__ = ("_charged_up_to", "_deliveries", "core", "epoch", "generation", "partition", "revoking",
                 "seek_generation", "start_offset")

    def __init__(self, partition: int, epoch: int, *, ordered: bool,
                 settled_before: frozenset[int] = frozenset(), attempts_before: dict[int, int] | None = None,
                 suspects: bool = True, generation: int = 0, start_offset: int | None = None,
                 seek_generation: int = 0, cascades: frozenset[int] = frozenset(), floor: int | None = None,
                 topic: str = "", submit: Callable[[Any], None] = unattached, acks: AckQueue | None = None) -> None:
        self.partition = partition
        self.epoch = epoch
        self.generation = generation
        self.seek_generation = seek_generation
        self.start_offset = start_offset
        self.revoking = False
        self.core: PartitionCore[Record] = PartitionCore(
            ordered=ordered, settled_before=set(settled_before), attempts_before=attempts_before or {},
            suspects=suspects, start_offset=start_offset, cascades=set(cascades), floor=floor)
        self._charged_up_to = max(attempts_before) if attempts_before else None
        self._deliveries = Deliveries(Message, topic, submit, ordered, acks)  # what releases make

    def charged_pending(self) -> bool:
        """Some record the claim charged attempts to is not settled yet (its commit point is not past
        the last of them)."""
        last = self._charged_up_to
        if last is None:
            return False
        watermark = self.core.watermark
        if watermark is None or watermark <= last:
            return True
        self._charged_up_to = None
        return False

    def add(self, records: list[Record], start: int = 0, stop: int | None = None) -> None:
        """Take fetched records ``records[start:stop]`` (duplicates and records settled before a
        crash are skipped)."""
        self.core.add(records, start, stop)

    def release_ready(self, now: float, budget: int, per_key: int, byte_budget: int, lease_ms: int | None,
                      *, pooled: bool, leases: LeaseTable | None = None, run_share: float = 0.0,
                      run_most: int = 0) -> tuple[list[Message], int]:
        """Release from the ready keys (``PartitionState.release_ready``): the messages and their
        payload bytes. Their attempts are queued for Redis as ``lease_ms`` and ``pooled`` say
        (``PartitionCore.release_ready``), and they are outstanding in ``leases`` (when given),
        watched together; each record carries its attempt count and whether it is a suspect (its
        start is written before user code runs, ``Engine.begin``). A key with more than ``per_key``
        records buffered may take ``run_share`` of them, up to ``run_most``. The core makes the
        messages (``PartitionCore.release_messages``)."""
        return self.core.release_messages(now, budget, per_key, byte_budget, lease_ms, pooled=pooled, leases=leases,
                                          partition=self.partition, epoch=self.epoch, deliveries=self._deliveries,
                                          run_share=run_share, run_most=run_most)

    def nack(self, delivery: Delivery, now: float, backoff: Callable[[int], float], *, lapsed: bool = False) -> bool:
        """Give a delivery back (a nack, or its lease lapsed): its key rewinds to it (SUB-4) and
        backs off (DLQ-1). False when the token is stale."""
        return self.core.nack(delivery.record.offset, delivery.token, now, backoff, lapsed=lapsed)

    def requeue(self, delivery: Delivery, now: float, delay: float, *, uncount: bool = False) -> bool:
        """Give a delivery back because the layer failed (no failure counted), held ``delay`` s;
        with ``uncount`` its attempt is taken back too. False when the token is stale."""
        if not self.core.requeue(delivery.record.offset, delivery.token, now, delay, uncount=uncount):
            return False
        if uncount:
            delivery.record.attempts -= 1
        return True

    def settle_dead_lettered(self, queue_key: QueueKey, offset: int) -> None:
        """A record's dead letter was written (DLQ-2): settle it."""
        self.core.settle_dead_lettered(offset, queue_key if isinstance(queue_key, bytes) else None)

    def push_op(self, kind: OpLetter, offset: int, value: int) -> None:
        """Queue an op the coordinator decided (``STARTED``, ``LEASE``) after those queued so far."""
        self.core.push_op(kind, offset, value)

    def take_ops(self, *, floor: bool = False) -> str:
        """The queued ops packed for ``apply.lua``; the queue is emptied. With ``floor`` (a flush takes
        them) the commit point follows as a ``FLOOR`` op when it rose since the last one."""
        return self.core.take_ops(floor=floor)

    @property
    def buffered(self) -> int:
        """Fetched records not yet released."""
        return self.core.buffered

    @property
    def ready(self) -> int:
        """Ready keys, at most (0 during the recovery walk): what a release could take now."""
        return self.core.ready

    @property
    def watermark(self) -> int | None:
        """The offset to commit: the lowest fetched offset not settled (ACK-4)."""
        return self.core.watermark

    def next_wake(self) -> float | None:
        """The earliest end of a backoff, if any key is backing off."""
        return self.core.next_wake()

    def held_keys(self) -> int:
        """Keys with something outstanding or backing off (a scan: for metrics)."""
        return self.core.held_keys()
