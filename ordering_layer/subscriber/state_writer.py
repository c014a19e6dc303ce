"""Typed state ops batched per partition, written to Redis in one round trip (ACK-4, ACK-5).

Each owned partition queues its ops (``OpKind``) in decision order in its compiled core
(``OwnedPartition``): the core those of its own decisions, the coordinator the others through
``push``. ``StateWriter`` counts them, and ``flush`` sends every owned partition's ops, packed, as one
fenced ``apply.lua`` call each, all in one pipeline, and resolves the ``ack_with_response`` futures
of each partition with the answer: SUCCESS when applied, LEASE_LOST when fenced (a newer owner) or
when the partition is no longer owned. Ops a failed flush took stay here for the next one. A flush
is due at ``max_ops`` ops or when the oldest op is ``max_age`` seconds old; the releasing step always
flushes first, so that attempts and leases are in Redis before user code sees the messages (DLQ-3).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Protocol

import redis

from ordering_layer.state import ApplyResult, StateStore
from ordering_layer.state.store import OpLetter
from ordering_layer.subscriber.message import AckResponse


class PartitionOps(Protocol):
    """A partition's queue of ops (``OwnedPartition``)."""

    epoch: int

    def push_op(self, kind: OpLetter, offset: int, value: int) -> None:
        """Queue one op after those queued so far."""

    def take_ops(self) -> str:
        """The queued ops, packed for ``apply.lua``; the queue is emptied."""


_LOGGER = logging.getLogger(__name__)

_OBSERVATIONS_KEPT = 10_000  # flush times kept for a metrics reader that does not come


def resolve(future: Future[AckResponse] | None, status: AckResponse) -> None:
    """Answer an ``*_with_response`` future once."""
    if future is not None and not future.done():
        future.set_result(status)


class StateWriter:
    """Counts of queued state ops, the ops a failed flush took, and ack futures of one engine,
    flushed in batches (coordinator thread only).

    Args:
        store: the Redis state store.
        subscription: subscription name.
        max_ops: a flush is due at this many queued ops.
        max_age: a flush is due when the oldest queued op is this many seconds old.
    """

    def __init__(self, store: StateStore, subscription: str, *, max_ops: int = 500, max_age: float = 0.005) -> None:
        self._store = store
        self._subscription = subscription
        self._max_ops = max_ops
        self._max_age = max_age
        self._unwritten: dict[int, str] = {}  # ops a failed flush took, packed, by partition
        self._futures: dict[int, list[Future[AckResponse]]] = {}
        self.count = 0
        self._oldest = 0.0
        self.flush_seconds: deque[float] = deque(maxlen=_OBSERVATIONS_KEPT)  # drained by metrics

    def queued(self, count: int, now: float) -> None:
        """``count`` ops were queued in partitions' cores."""
        if count:
            if not self.count:
                self._oldest = now
            self.count += count

    def push(self, state: PartitionOps, kind: OpLetter, offset: int, value: int, now: float) -> None:
        """Queue an op the coordinator decided in the partition's queue."""
        state.push_op(kind, offset, value)
        if not self.count:
            self._oldest = now
        self.count += 1

    def add_future(self, partition: int, future: Future[AckResponse] | None) -> None:
        """Answer ``future`` when the partition's queued ops are written."""
        if future is not None:
            self._futures.setdefault(partition, []).append(future)

    def due(self, now: float) -> bool:
        """A flush is due (size or age cap)."""
        return self.count >= self._max_ops or (self.count > 0 and now - self._oldest >= self._max_age)

    def next_due(self) -> float | None:
        """When the queued ops are due by age (None when nothing is queued)."""
        return self._oldest + self._max_age if self.count else None

    def drop(self, partition: int) -> None:
        """A partition let go or restarted: ops a failed flush took are not written, its futures learn
        LEASE_LOST (the ops still queued go with its state)."""
        self._unwritten.pop(partition, None)
        for future in self._futures.pop(partition, []):
            resolve(future, AckResponse.LEASE_LOST)

    def flush(self, owned: Mapping[int, PartitionOps]) -> dict[int, ApplyResult] | None:
        """Write the queued ops of the ``owned`` partitions in one round trip. Returns each written
        partition's result; None when Redis failed (the ops are kept for the next flush). Futures of
        partitions not owned learn LEASE_LOST."""
        subscription, unwritten = self._subscription, self._unwritten
        batches = []
        for partition, state in owned.items():
            packed = unwritten.pop(partition, "") + state.take_ops()
            if packed:
                batches.append((subscription, partition, state.epoch, packed))
        results: dict[int, ApplyResult] = {}
        if batches:
            start = time.perf_counter()
            try:
                answers = self._store.apply_packed(batches)
            except redis.RedisError as exc:
                _LOGGER.warning("%s: Redis write failed (%s); will retry", subscription, exc)
                for _, partition, _, packed in batches:
                    unwritten[partition] = packed
                return None
            self.flush_seconds.append(time.perf_counter() - start)
            results = {batch[1]: answer for batch, answer in zip(batches, answers, strict=True)}
        futures = self._futures
        self._futures, self.count = {}, 0
        for partition, waiting in futures.items():
            result = results.get(partition)
            status = AckResponse.LEASE_LOST if result in (None, ApplyResult.FENCED) else AckResponse.SUCCESS
            for future in waiting:
                resolve(future, status)
        return results
