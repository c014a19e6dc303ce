"""The flush pipeline of a running engine: queued Redis ops written, answers applied, releases delivered.

Flushes write every owned partition's queued ops in one round trip and apply Redis's verdicts: a
partition a newer owner has fenced is let go (``fenced``), one whose state Redis lost is adopted
again. Released messages wait for the flush that takes their attempts (``hold``), then ``deliver``
hands them out, or gives them back when Redis failed (DLQ-3). A delivery's lease is not written with
its release: the first flush that begins ``LEASE_WRITE_AGE`` after the release writes it if the
delivery is still outstanding (``LeaseTable.write_leases``; a flush is due for it then), so that the
many settled sooner never reach Redis's leases hash (ACK-4). The coordinator takes acks and releases
while Redis works (``start``, ``poll``): with a pipelined writer (``StateWriter.pipe``: a single Redis
server) it writes a flush, a second behind the first for messages released meanwhile, and reads each
answer once it has come; on a cluster a thread of its own makes one round trip at a time. Either way
a partition's ops reach Redis in the order queued, and the answers apply in the order sent (a flush
sent after one that failed counts as failed too). ``flush`` writes at once, after the flushes in
flight (a revocation, a seek, a close).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ordering_layer.state import ApplyResult
from ordering_layer.subscriber.leases import LeaseTable
from ordering_layer.subscriber.partitions import Partitions, Released
from ordering_layer.subscriber.state_writer import Flush, StateWriter

# A delivery still outstanding this long after its release has its lease written to Redis by the next
# flush (one is due for it then); those settled sooner never have (seconds).
LEASE_WRITE_AGE = 0.05


class Flushes:
    """The Redis writes of one engine's partitions, under the coordinator's lock.

    Args:
        subscription: subscription name (names the sending thread).
        owned: the owned partitions.
        leases: the outstanding deliveries.
        writer: the queued Redis ops.
        fenced: lets go of a partition Redis refused a write of (a newer owner has it).
        deliver: takes one release's messages once a flush answered for them: True when Redis took
            their attempts (hand them out), False when it failed (give them back).
        wake: called on the sending thread when a flush it made or wrote is done.
    """

    def __init__(self, subscription: str, owned: Partitions, leases: LeaseTable, writer: StateWriter,
                 fenced: Callable[[int], None], deliver: Callable[[Released, bool], None] | None = None,
                 wake: Callable[[], None] | None = None) -> None:
        self._subscription = subscription
        self._owned = owned
        self._leases = leases
        self._writer = writer
        self._fenced = fenced
        self._deliver = deliver
        self._wake = wake
        self._held: list[Released] = []  # releases, their ops queued, waiting for the next flush
        # In the order sent, each with the sending thread's future (None: written by the coordinator).
        self._flights: deque[tuple[Flush, list[Released], Future[None] | None]] = deque()
        self._failed: Exception | None = None  # a flush in flight before those still in flight failed
        self._sender: ThreadPoolExecutor | None = None
        self._writing: Future[None] | None = None  # the last flush written on the sending thread

    def hold(self, released: Released) -> None:
        """One release's messages wait for the flush that takes their attempts and leases (DLQ-3)."""
        if released:
            self._held.append(released)

    def start(self, now: float) -> None:
        """Send the next flush when messages wait for it, ops are due or leases are due to be
        written, and none is in flight; with a pipelined writer, a second one while the first is in
        flight when messages wait for it (their hand-out need not wait for the first's answer)."""
        flights = self._flights
        if flights and (len(flights) >= self._writer.max_in_flight or not self._held):
            return
        if not (self._held or self._writer.due(now)):
            oldest = self._leases.next_lease_write()
            if oldest is None or now < oldest + LEASE_WRITE_AGE:
                return
        flush, releases = self._take()
        if not flush.batches:
            self._finish(flush, releases)
            return
        done = self._send(flush)
        flights.append((flush, releases, done))
        wake = self._wake
        if wake is not None and done is not None:
            done.add_done_callback(lambda _: wake())

    def _send(self, flush: Flush) -> Future[None] | None:
        """The round trip of a flush on the sending thread (its future is done when answered), or,
        pipelined, its write: here when the connection is open and every earlier flush is written (a
        socket write of at most two flushes in flight, which Redis reads as they come; None), on the
        sending thread when it needs a new connection (the first, or after a failure: connect and
        script load; its future is done when written). A pipelined flush's answers are read by the
        coordinator (``poll``), flushes in the order written, once they have come (``answer_socket``
        lets it wait for them with its events)."""
        writer = self._writer
        if self._sender is None:
            self._sender = ThreadPoolExecutor(1, thread_name_prefix=f"ordering-layer-redis-{self._subscription}")
        if writer.pipe is None:
            return self._sender.submit(writer.send, flush)
        writing = self._writing
        if writer.pipe.ready and (writing is None or writing.done()):
            writer.write(flush)
            return None
        self._writing = self._sender.submit(writer.write, flush)
        return self._writing

    def poll(self) -> None:
        """Apply the answers of the flushes in flight that came, in the order sent."""
        flights, writer = self._flights, self._writer
        while flights:
            flush, _, done = flights[0]
            if (done is not None and not done.done()) or not writer.answered(flush):
                return
            writer.read(flush)
            self._settle(*flights.popleft())

    def answer_socket(self) -> Any:
        """The socket the oldest flush's answers come on, while they are awaited (pipelined, written)."""
        flush, _, done = self._flights[0] if self._flights else (None, None, None)
        if flush is None or flush.sent is None or self._writer.pipe is None or (done is not None and not done.done()):
            return None
        return self._writer.pipe.socket(flush.sent)

    @property
    def in_flight(self) -> int:
        """How many flushes are in flight."""
        return len(self._flights)

    def next_due(self) -> float | None:
        """When a flush is due by age or for leases to write; while one is in flight, when its answer
        is (None: the sending thread wakes the coordinator; now: it came, or its write failed)."""
        if self._flights:
            flush, _, done = self._flights[0]
            if done is not None and not done.done():
                return None
            return time.monotonic() + self._writer.answer_due(flush)
        due, oldest = self._writer.next_due(), self._leases.next_lease_write()
        if oldest is not None:
            return oldest + LEASE_WRITE_AGE if due is None else min(due, oldest + LEASE_WRITE_AGE)
        return due

    def flush(self) -> bool:
        """Write every owned partition's queued ops now, after the flushes in flight; False when Redis
        failed."""
        self.settle_in_flight()
        flush, releases = self._take()
        self._writer.send(flush)
        return self._finish(flush, releases)

    def close(self) -> None:
        """Stop the sending thread (after the last ``flush``)."""
        if self._sender is not None:
            self._sender.shutdown(wait=True)
        self._writer.close()

    def settle_in_flight(self) -> None:
        """Wait for the answers of the flushes in flight, if any, and apply them in order."""
        flights = self._flights
        while flights:
            flush, releases, done = flights.popleft()
            if done is not None:
                done.result()
            self._writer.read(flush)
            self._settle(flush, releases, done)

    def _settle(self, flush: Flush, releases: list[Released], _: Future[None] | None) -> None:
        """Apply a flush's answer. A flush sent after one that failed counts as failed too, whatever
        Redis answered: its ops go again after the failed one's, so that each partition's ops end
        applied in the order queued (a batch applied twice leaves what it left once)."""
        if flush.error is None and self._failed is not None:
            flush.error = self._failed
        self._failed = flush.error if self._flights else None
        self._finish(flush, releases)

    def _take(self) -> tuple[Flush, list[Released]]:
        """The queued ops of every owned partition, and the releases waiting for them; first the
        leases of the deliveries still outstanding since the previous flush are queued (ACK-4)."""
        releases, self._held = self._held, []
        owned = self._owned.owned
        now = time.monotonic()
        self._writer.queued(self._leases.write_leases(owned, now - LEASE_WRITE_AGE), now)
        return self._writer.begin(owned), releases

    def _finish(self, flush: Flush, releases: list[Released]) -> bool:
        """Apply a flush's verdicts to the partitions still owned as they were when it began, then
        deliver the messages released for it."""
        owned = self._owned
        results = self._writer.finish(flush, owned.owned)
        if results is not None:
            states = {batch[1]: state for batch, state in zip(flush.batches, flush.states, strict=True)}
            for partition, result in results.items():
                if owned.owned.get(partition) is not states[partition]:
                    continue  # let go while the flush was in flight
                if result == ApplyResult.FENCED:
                    self._fenced(partition)
                elif result == ApplyResult.ADOPTED:
                    owned.adopted(partition)
        if self._deliver is not None:
            for released in releases:
                self._deliver(released, results is not None)
        return results is not None
