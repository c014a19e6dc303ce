"""Typed state ops batched per partition, written to Redis in one round trip (ACK-4, ACK-5).

The coordinator queues ops (``OpKind``) as it decides; ``flush`` sends every owned partition's ops
as one fenced ``apply.lua`` call each, all in one pipeline, and resolves the ``ack_with_response``
futures of each partition with the answer: SUCCESS when applied, LEASE_LOST when fenced (a newer
owner) or when the partition is no longer owned. A flush is due at ``max_ops`` ops or when the
oldest op is ``max_age`` seconds old; the releasing step always flushes first, so that attempts and
leases are in Redis before user code sees the messages (DLQ-3).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future

import redis

from ordering_layer.state import ApplyResult, StateStore
from ordering_layer.state.store import Op
from ordering_layer.subscriber.message import AckResponse

_LOGGER = logging.getLogger(__name__)

_OBSERVATIONS_KEPT = 10_000  # flush times kept for a metrics reader that does not come


def resolve(future: Future[AckResponse] | None, status: AckResponse) -> None:
    """Answer an ``*_with_response`` future once."""
    if future is not None and not future.done():
        future.set_result(status)


class StateWriter:
    """Queued state ops and ack futures of one engine, flushed in batches (coordinator thread only).

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
        self._ops: dict[int, list[Op]] = {}
        self._futures: dict[int, list[Future[AckResponse]]] = {}
        self.count = 0
        self._oldest = 0.0
        self.flush_seconds: deque[float] = deque(maxlen=_OBSERVATIONS_KEPT)  # drained by metrics

    def add(self, partition: int, op: Op, now: float) -> None:
        """Queue one op."""
        if not self.count:
            self._oldest = now
        self.count += 1
        ops = self._ops.get(partition)
        if ops is None:
            self._ops[partition] = [op]
        else:
            ops.append(op)

    def extend(self, partition: int, ops: list[Op], now: float) -> None:
        """Queue several ops of one partition."""
        if not self.count:
            self._oldest = now
        self.count += len(ops)
        queued = self._ops.get(partition)
        if queued is None:
            self._ops[partition] = ops
        else:
            queued.extend(ops)

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
        """A partition let go: its queued ops are not written, its futures learn LEASE_LOST."""
        self._ops.pop(partition, None)
        for future in self._futures.pop(partition, []):
            resolve(future, AckResponse.LEASE_LOST)

    def flush(self, epochs: Mapping[int, int]) -> dict[int, ApplyResult] | None:
        """Write the queued ops of the partitions in ``epochs`` (partition -> owner epoch) in one round
        trip. Returns each written partition's result; None when Redis failed (everything stays
        queued for the next flush). Ops of partitions not owned are dropped (LEASE_LOST)."""
        subscription = self._subscription
        batches = [(subscription, p, epochs[p], ops) for p, ops in self._ops.items() if ops and p in epochs]
        results: dict[int, ApplyResult] = {}
        if batches:
            start = time.perf_counter()
            try:
                answers = self._store.apply_many(batches)
            except redis.RedisError as exc:
                _LOGGER.warning("%s: Redis write failed (%s); will retry", subscription, exc)
                return None
            self.flush_seconds.append(time.perf_counter() - start)
            results = {batch[1]: answer for batch, answer in zip(batches, answers, strict=True)}
        futures = self._futures
        self._ops, self._futures, self.count = {}, {}, 0
        for partition, waiting in futures.items():
            result = results.get(partition)
            status = AckResponse.LEASE_LOST if result in (None, ApplyResult.FENCED) else AckResponse.SUCCESS
            for future in waiting:
                resolve(future, status)
        return results
