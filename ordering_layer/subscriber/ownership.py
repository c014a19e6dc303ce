"""Ownership of partitions at a running engine: assignment, revocation, loss and fencing.

The fetch thread tells the coordinator of rebalances on its own thread (``fetcher.Ownership``), and
this is the coordinator's side of them, under its lock: an assignment claims the partitions in Redis
before their first fetch (``Partitions.claim``, ACK-5; a claim that applied a seek gives the offset
to start at, GRP-3); a revocation lets the deliveries in progress finish first (affinity, SUB-5),
writes what was decided and returns the commit points to commit before the partitions move; a loss
lets go at once. A partition let go (``drop``) takes its queued ops (their ``ack_with_response``
futures learn LEASE_LOST) and its outstanding deliveries with it (a later ack is refused).

Flushes write every owned partition's queued ops in one round trip and apply Redis's verdicts: a
partition a newer owner has fenced is dropped, one whose state Redis lost is adopted again. Released
messages wait for the flush that takes their attempts (``hold``), then ``deliver`` hands them out,
or gives them back when Redis failed (DLQ-3). A delivery's lease is not written with its release:
the first flush that begins ``LEASE_WRITE_AGE`` after the release writes it if the delivery is still
outstanding (``LeaseTable.write_leases``; a flush is due for it then), so that the many settled
sooner never reach Redis's leases hash (ACK-4). The coordinator takes acks and releases while Redis
works (``start``, ``poll``): with a pipelined writer (``StateWriter.pipe``: a single Redis server) it
writes a flush, a second behind the first for messages released meanwhile, and reads each answer once
it has come; on a cluster a thread of its own makes one round trip at a time. Either way a
partition's ops reach Redis in the order queued, and the answers apply in the order sent (a flush
sent after one that failed counts as failed too). ``flush`` writes at once, after the flushes in
flight (a revocation, a seek, a close). A seek (GRP-3) claims owned partitions again
(``apply_seeks``): what they had outstanding is void.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from confluent_kafka import TopicPartition

from ordering_layer.config import SubscriptionSettings
from ordering_layer.state import ApplyResult
from ordering_layer.subscriber.commits import Commits
from ordering_layer.subscriber.leases import LeaseTable
from ordering_layer.subscriber.partitions import Partitions, Released
from ordering_layer.subscriber.state_writer import Flush, StateWriter

_LOGGER = logging.getLogger(__name__)

_REVOKE_GRACE = 30.0  # the longest a revocation waits for deliveries in progress (seconds)
# A delivery still outstanding this long after its release has its lease written to Redis by the next
# flush (one is due for it then); those settled sooner never have (seconds).
LEASE_WRITE_AGE = 0.05


class Ownership:
    """Claims, revocations, losses and fencing of one engine's partitions.

    Args:
        subscription: subscription name (for logs).
        settings: the subscription's settings (the ack deadline bounds a revocation's wait).
        changed: the coordinator's lock, as the condition its thread notifies after each step.
        owned: the owned partitions.
        leases: the outstanding deliveries.
        writer: the queued Redis ops.
        commits: the commit points.
        deliver: takes one release's messages once a flush answered for them: True when Redis took
            their attempts (hand them out), False when it failed (give them back).
        wake: called on the sending thread when a flush it made or wrote is done.
        withdraw: gives back what was released ahead of the pulls in partitions being revoked.
    """

    def __init__(self, subscription: str, settings: SubscriptionSettings, changed: threading.Condition,
                 owned: Partitions, leases: LeaseTable, writer: StateWriter, commits: Commits,
                 deliver: Callable[[Released, bool], None] | None = None,
                 wake: Callable[[], None] | None = None,
                 withdraw: Callable[[list[int]], None] | None = None) -> None:
        self._subscription = subscription
        self._settings = settings
        self._changed = changed
        self._owned = owned
        self._leases = leases
        self._writer = writer
        self._commits = commits
        self._deliver = deliver
        self._wake = wake
        self._withdraw = withdraw
        self._held: list[Released] = []  # releases, their ops queued, waiting for the next flush
        # In the order sent, each with the sending thread's future (None: written by the coordinator).
        self._flights: deque[tuple[Flush, list[Released], Future[None] | None]] = deque()
        self._failed: Exception | None = None  # a flush in flight before those still in flight failed
        self._sender: ThreadPoolExecutor | None = None
        self._writing: Future[None] | None = None  # the last flush written on the sending thread

    # -- fetch thread ------------------------------------------------------------------------------
    def assigned(self, partitions: list[int], generations: Mapping[int, int]) -> Mapping[int, int]:
        """Claim newly assigned partitions (before their first fetch); returns where a claim applied a
        seek (GRP-3), to start there."""
        starts = {}
        owned = self._owned
        with self._changed:
            for number in partitions:
                if owned.claim(number, generations[number], assigning=True):
                    start = owned.owned[number].start_offset
                    if start is not None:
                        starts[number] = start
        return starts

    def revoking(self, partitions: list[int]) -> list[TopicPartition]:
        """Let revoked partitions go after their deliveries in progress finish (SUB-5); returns the
        offsets to commit."""
        with self._changed:
            for number in partitions:
                state = self._owned.owned.get(number)
                if state is not None:
                    state.revoking = True
            if self._withdraw is not None:
                self._withdraw(partitions)  # released ahead of the pulls: no user code has them
            # Affinity (SUB-5): let the deliveries in progress finish before the keys can move.
            deadline = time.monotonic() + min(self._settings.ack_deadline, _REVOKE_GRACE)
            while self._leases.count_in(partitions) and time.monotonic() < deadline:
                self._changed.wait(0.05)
            self.flush()
            offsets = self._commits.offsets(sync=True, only=partitions)
            for number in partitions:
                self.drop(number)
            return offsets

    def lost(self, partitions: list[int]) -> None:
        """Drop lost partitions: another owner has them already."""
        with self._changed:
            for number in partitions:
                self.drop(number)

    # -- under the coordinator's lock ----------------------------------------------------------------
    def drop(self, partition: int) -> None:
        """Let go of a partition: its outstanding deliveries can no longer be acked here."""
        self._owned.drop(partition)
        self.void(partition)

    def void(self, partition: int) -> None:
        """Forget a partition's queued ops and outstanding deliveries (let go, or restarted by a seek)."""
        self._writer.drop(partition)
        self._leases.drop_partition(partition)

    def fenced(self, partition: int) -> None:
        """Redis refused a write of the partition: a newer owner has it."""
        _LOGGER.warning("%s: partition %d fenced by a newer owner; dropping it", self._subscription, partition)
        self.drop(partition)

    def apply_seeks(self) -> None:
        """Apply a newly announced seek (GRP-3, ``Commits.look_for_seek``): the partitions claimed
        again lose their queued ops and outstanding deliveries; fenced ones are let go."""
        restarted, fenced = self._commits.look_for_seek(self.flush)
        for partition in fenced:
            self.fenced(partition)
        for partition in restarted:
            self.void(partition)

    # -- flushes --------------------------------------------------------------------------------------
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
                    self.fenced(partition)
                elif result == ApplyResult.ADOPTED:
                    owned.adopted(partition)
        if self._deliver is not None:
            for released in releases:
                self._deliver(released, results is not None)
        return results is not None
