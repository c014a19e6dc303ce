"""Typed state ops batched per partition, written to Redis in one round trip (ACK-4, ACK-5).

Each owned partition queues its ops (``OpKind``) in decision order in its compiled core
(``OwnedPartition``): the core those of its own decisions, the coordinator the others through
``push``. ``StateWriter`` counts them; a flush takes every owned partition's ops (``begin``), sends
them, each partition's commit point last as its floor (``OpKind.FLOOR``, when it rose), as one fenced
``apply.lua`` call each (the Redis command runs they make), all in one pipeline
(``send``: on any thread, so that the coordinator works on while Redis does), and resolves the
``ack_with_response`` futures of each partition with the answer (``finish``): SUCCESS when applied,
LEASE_LOST when fenced (a newer owner) or when the partition is no longer owned. Ops a failed flush
took stay here for the next one. A flush is due at ``max_ops`` ops or when the oldest op is
``max_age`` seconds old; released messages are handed out only after the flush that took their
attempts and leases (DLQ-3).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Protocol

from ordering_layer.state import ApplyResult, StateStore
from ordering_layer.state.pipe import ApplyPipe, Sent
from ordering_layer.state.store import OpLetter
from ordering_layer.subscriber.message import AckResponse


class PartitionOps(Protocol):
    """A partition's queue of ops (``OwnedPartition``)."""

    epoch: int

    def push_op(self, kind: OpLetter, offset: int, value: int) -> None:
        """Queue one op after those queued so far."""

    def take_ops(self, *, floor: bool = False) -> str:
        """The queued ops, packed for ``apply.lua``; the queue is emptied. With ``floor`` the commit
        point follows them as a ``FLOOR`` op when it rose."""


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
        pipelined: flushes may be written back to back on one connection (``ApplyPipe``; the store
            must allow it, ``StateStore.pipelines``): two may be in flight at once.
    """

    def __init__(self, store: StateStore, subscription: str, *, max_ops: int = 500, max_age: float = 0.005,
                 pipelined: bool = False) -> None:
        self._store = store
        self.pipe = ApplyPipe(store) if pipelined else None
        self.max_in_flight = 1 if self.pipe is None else 2
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

    def begin(self, owned: Mapping[int, PartitionOps]) -> Flush:
        """Take the queued ops of the ``owned`` partitions (and the futures waiting for them) for one
        round trip; ``send`` makes it (any thread) and ``finish`` applies its answer."""
        subscription, unwritten = self._subscription, self._unwritten
        flush = Flush(self.count, self._oldest, self._futures)
        for partition, state in owned.items():
            packed = unwritten.pop(partition, "") + state.take_ops(floor=True)
            if packed:
                flush.batches.append((subscription, partition, state.epoch, packed))
                flush.states.append(state)
        self._futures, self.count = {}, 0
        return flush

    def send(self, flush: Flush) -> None:
        """The round trip of a begun flush (any thread; the writer's own state is not touched)."""
        if not flush.batches:
            return
        start = time.perf_counter()
        try:
            flush.answers = self._store.apply_packed(flush.batches)
        except Exception as exc:  # noqa: BLE001 - kept for finish, on the coordinator's thread
            flush.error = exc
            return
        self.flush_seconds.append(time.perf_counter() - start)

    def write(self, flush: Flush) -> None:
        """Pipelined: write a begun flush's calls (the coordinator); ``read`` takes its answers."""
        if not flush.batches or self.pipe is None:
            return
        flush.started = time.perf_counter()
        try:
            flush.sent = self.pipe.send(flush.batches)
        except Exception as exc:  # noqa: BLE001 - kept for finish, on the coordinator's thread
            flush.error = exc

    def read(self, flush: Flush) -> None:
        """Pipelined: read the answers of a written flush (flushes in the order written), once."""
        sent, flush.sent = flush.sent, None
        if sent is None or self.pipe is None:
            return
        try:
            flush.answers = self.pipe.receive(sent)
        except Exception as exc:  # noqa: BLE001 - kept for finish
            flush.error = exc
            return
        self.flush_seconds.append(time.perf_counter() - flush.started)

    def answer_due(self, flush: Flush) -> float:
        """Pipelined, written: seconds until a flush's answers are due (0: they can be read now)."""
        sent, pipe = flush.sent, self.pipe
        if sent is None or pipe is None or pipe.answered(sent):
            return 0.0
        return max(0.0, flush.started + pipe.timeout(sent) - time.perf_counter())

    def answered(self, flush: Flush) -> bool:
        """Pipelined: a flush's answers can be read without waiting (or it needs no reading: not
        written, failed, or read); one unanswered past its connection's timeout fails."""
        sent, pipe = flush.sent, self.pipe
        if sent is None or pipe is None or pipe.answered(sent):
            return True
        if time.perf_counter() - flush.started < pipe.timeout(sent):
            return False
        pipe.fail(sent)
        flush.sent, flush.error = None, TimeoutError(f"no answer from Redis in {pipe.timeout(sent):.0f} s")
        return True

    def close(self) -> None:
        """Give the pipelined connection back (after the last flush)."""
        if self.pipe is not None:
            self.pipe.close()

    def finish(self, flush: Flush, owned: Mapping[int, PartitionOps]) -> dict[int, ApplyResult] | None:
        """Apply a sent flush's answer: each written partition's result, or None when Redis failed
        (the ops of partitions still owned by the same state are kept for the next flush, ahead of
        those queued since and after those of a failed flush written before it, and its futures wait
        for that flush). Futures of partitions not written or fenced learn LEASE_LOST, the others
        SUCCESS."""
        if flush.error is not None:
            _LOGGER.warning("%s: Redis write failed (%s); will retry", self._subscription, flush.error)
            unwritten = self._unwritten
            for (_, partition, epoch, packed), state in zip(flush.batches, flush.states, strict=True):
                if owned.get(partition) is state and state.epoch == epoch:
                    unwritten[partition] = unwritten.get(partition, "") + packed
            for partition, waiting in flush.futures.items():
                self._futures.setdefault(partition, []).extend(waiting)
            self._oldest = min(self._oldest, flush.oldest) if self.count else flush.oldest
            self.count += max(flush.count, 1)
            return None
        results = {batch[1]: answer for batch, answer in zip(flush.batches, flush.answers, strict=True)}
        for partition, waiting in flush.futures.items():
            result = results.get(partition)
            status = AckResponse.LEASE_LOST if result in (None, ApplyResult.FENCED) else AckResponse.SUCCESS
            for future in waiting:
                resolve(future, status)
        return results

    def flush(self, owned: Mapping[int, PartitionOps]) -> dict[int, ApplyResult] | None:
        """Write the queued ops of the ``owned`` partitions in one round trip, on this thread: ``begin``,
        ``send`` and ``finish``."""
        flush = self.begin(owned)
        self.send(flush)
        return self.finish(flush, owned)


class Flush:
    """One round trip of queued ops: what was taken (``StateWriter.begin``) and Redis's answer."""

    __slots__ = ("answers", "batches", "count", "error", "futures", "oldest", "sent", "started", "states")

    def __init__(self, count: int, oldest: float, futures: dict[int, list[Future[AckResponse]]]) -> None:
        self.count = count  # ops counted when taken, and when the oldest of them was queued
        self.oldest = oldest
        self.futures = futures
        self.batches: list[tuple[str, int, int, str]] = []  # (subscription, partition, epoch, packed ops)
        self.states: list[PartitionOps] = []  # the partition state each batch was taken from
        self.answers: list[ApplyResult] = []
        self.error: Exception | None = None  # what the round trip raised
        self.sent: Sent | None = None  # pipelined: where its answers are to be read, until read
        self.started = 0.0
