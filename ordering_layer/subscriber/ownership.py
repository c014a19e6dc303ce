"""Ownership of partitions at a running engine: assignment, revocation, loss and fencing.

The fetch thread tells the coordinator of rebalances on its own thread (``fetcher.Ownership``), and
this is the coordinator's side of them, under its lock: an assignment claims the partitions in Redis
before their first fetch (``Partitions.claim``, ACK-5; a claim that applied a seek gives the offset
to start at, GRP-3); a revocation lets the deliveries in progress finish first (affinity, SUB-5),
writes what was decided (``Flushes.flush``) and returns the commit points to commit before the
partitions move; a loss lets go at once. A partition let go (``drop``) takes its queued ops (their
``ack_with_response`` futures learn LEASE_LOST) and its outstanding deliveries with it (a later ack is
refused). A partition Redis fenced (a newer owner has it) is let go too. A seek (GRP-3) claims owned
partitions again (``apply_seeks``): what they had outstanding is void."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from confluent_kafka import TopicPartition

from ordering_layer.config import SubscriptionSettings
from ordering_layer.subscriber.commits import Commits
from ordering_layer.subscriber.flushes import Flushes
from ordering_layer.subscriber.leases import LeaseTable
from ordering_layer.subscriber.partitions import Partitions
from ordering_layer.subscriber.state_writer import StateWriter

_LOGGER = logging.getLogger(__name__)

_REVOKE_GRACE = 30.0  # the longest a revocation waits for deliveries in progress (seconds)


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
        flushes: the flush pipeline; its verdicts of fencing come back to ``fenced``.
        withdraw: gives back what was released ahead of the pulls in partitions being revoked.
    """

    def __init__(self, subscription: str, settings: SubscriptionSettings, changed: threading.Condition,
                 owned: Partitions, leases: LeaseTable, writer: StateWriter, commits: Commits, flushes: Flushes,
                 withdraw: Callable[[list[int]], None] | None = None) -> None:
        self._subscription = subscription
        self._settings = settings
        self._changed = changed
        self._owned = owned
        self._leases = leases
        self._writer = writer
        self._commits = commits
        self._flushes = flushes
        self._withdraw = withdraw

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
            self._flushes.flush()
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
        restarted, fenced = self._commits.look_for_seek(self._flushes.flush)
        for partition in fenced:
            self.fenced(partition)
        for partition in restarted:
            self.void(partition)
