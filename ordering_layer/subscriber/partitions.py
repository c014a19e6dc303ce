"""Ownership of partitions: claims, the recovery walk's inputs, and assignment generations.

A partition assigned to this subscriber is claimed in Redis (a new owner epoch, ACK-5; the offsets
settled above the committed offset and the attempt counts, for the recovery walk of SUB-3/SUB-4 and
ACK-6) and gets an ``OwnedPartition`` tagged with the assignment generation it was claimed under.
Fetched records reach a partition's state only when they were fetched under that same generation:
records fetched for an ownership that has ended are dropped, the current owner refetches them from
the committed offset (SUB-3). A claim that fails (Redis down) keeps the partition's records waiting
and is retried when more of them arrive.

Seeks (GRP-3): a claim applies a pending seek (the partition starts at its target); a running
owner applies one when it is announced (``apply_seeks``): the partition is claimed again, which
fences everything of before, and its state restarts at the target, waiting (``AWAITING_SEEK``) until
the fetcher reports the consumer sought (``sought``). Commits carry the partition's seek generation
(``seek_tag``), so that reports of commits made before a seek are told apart; the first report of a
commit made after it marks the seek applied in Redis (``confirm``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import redis
from confluent_kafka import TopicPartition

from ordering_layer._core import AckQueue, LeaseTable, partition_runs
from ordering_layer.config import SubscriptionSettings
from ordering_layer.errors import OrderingLayerError
from ordering_layer.kafka.offsets import seek_tag
from ordering_layer.state import ClaimedPartition, StateStore
from ordering_layer.state.departed import Departed
from ordering_layer.subscriber.message import Message, unattached
from ordering_layer.subscriber.owned_partition import OwnedPartition
from ordering_layer.subscriber.records import AWAITING_SEEK, Record
from ordering_layer.subscriber.requests import Fetched, SeekPartition

_LOGGER = logging.getLogger(__name__)

Released = list[tuple[OwnedPartition, list[Message]]]  # released messages, by partition


def charged_attempts(claimed: ClaimedPartition, max_attempts: int | None) -> dict[int, int]:
    """The delivery attempts each unsettled offset of a claimed partition is charged with (ACK-6,
    DLQ-3); its next delivery is the attempt after that.

    An attempt that user code started (a pull it was released for handed it out, or its start was
    recorded) counts in full: its owner may have crashed on it. An attempt still waiting in a callback
    pool or released ahead of the pulls when its owner went may never have reached user code, or its
    start mark was lost with the owner: it counts, but never up to ``max_attempts``, so that a message
    is dead-lettered only after an attempt whose start is recorded. In callback mode the records charged
    are suspects: the new owner records the start of each of their deliveries before user code runs
    (``Starts.begin``), and lets those charged two attempts or more out one at a time per partition
    (the core's ``Quarantine``); in pull mode they go out only to a waiting pull, written as delivered
    (``release``, not ``ahead``). So a message that crashes every process it runs in is dead-lettered
    after exactly ``max_attempts`` deliveries; in callback mode one that waited or ran beside it is
    charged for two crashes at most and never dead-lettered for them. A message whose dead letter was being written when
    its owner went is charged ``max_attempts``.

    Args:
        claimed: what the claim read.
        max_attempts: the dead-letter policy's ``max_delivery_attempts``; None without a policy.
    """
    if max_attempts is None:
        return dict(claimed.attempts)
    unstarted, ceiling = claimed.unstarted, max_attempts - 1
    # An attempt beyond max_attempts was on its way to the dead-letter topic, not to user code: the
    # message had max_attempts deliveries, and a dead letter written again says so.
    return {offset: max_attempts if n > max_attempts else min(n, ceiling) if offset in unstarted else n
            for offset, n in claimed.attempts.items()}


class Partitions:
    """The partitions one engine owns (used under the engine's lock).

    Args:
        store: the Redis state store (claims).
        subscription: subscription name.
        settings: the subscription's settings (ordering on or off; stored again after a Redis loss).
        suspects: callback mode: records charged at a claim are suspects (``OwnedPartition``).
        submit: where the released messages post their requests (the engine's inbox).
        acks: where they put a first plain ack (the engine's ``AckQueue``).
        counts_for: the topic's partition-count history for a partition claimed (``MoveGuard``).
        departed_for: the marks of keys that left a partition claimed, with their seek generations
            (``MoveGuard``; raises ``redis.RedisError`` or ``OrderingLayerError``).
    """

    def __init__(self, store: StateStore, subscription: str, settings: SubscriptionSettings, *,
                 suspects: bool = True, submit: Callable[[Any], None] = unattached, acks: AckQueue | None = None,
                 counts_for: Callable[[int], list[tuple[int, int]]] = lambda partition: [],
                 departed_for: Callable[[int], list[Departed]] = lambda partition: []) -> None:
        self._store = store
        self._counts_for = counts_for
        self._departed_for = departed_for
        self._submit = submit
        self._acks = acks
        self._suspects = suspects
        self._subscription = subscription
        self._settings = settings
        self.owned: dict[int, OwnedPartition] = {}
        self._unclaimed: dict[int, tuple[int, list[Record]]] = {}  # generation, records waiting
        self._committed: dict[int, int] = {}  # the last commit point queued or made per partition
        self._rotation = 0
        self.seeks: list[SeekPartition] = []  # consumer seeks for the fetcher, taken by the engine
        # Seeks applied whose target is not yet known committed: partition -> (epoch, seek generation).
        # Kept past a drop: the commit of a revoke or close follows it.
        self._unconfirmed: dict[int, tuple[int, int]] = {}

    def claim(self, partition: int, generation: int, *, assigning: bool = False) -> bool:
        """Claim a partition assigned under ``generation``; False when Redis failed (retried later).

        A claim that applied a pending seek starts the state at the seek's target (``start_offset``):
        when ``assigning`` (before the first fetch) the fetcher starts the consumer there; otherwise
        the consumer fetches already, and a seek is queued for it (``seeks``).
        """
        try:
            # Read before the claim: when they cannot be read, the partition stays unclaimed (retried).
            departed = self._departed_for(partition) if len(self._counts_for(partition)) > 1 else []
            claimed = self._store.claim(self._subscription, partition)
        except (redis.RedisError, OrderingLayerError) as exc:
            _LOGGER.warning("claiming partition %d of %s failed (%s); retrying", partition, self._subscription, exc)
            entry = self._unclaimed.get(partition)
            if entry is None or entry[0] != generation:
                self._unclaimed[partition] = (generation, [])
            return False
        waited, waiting = self._unclaimed.pop(partition, (generation, []))
        if claimed.seek_offset is not None and not assigning:
            self._restart(partition, claimed)
            return True
        state = self._new_state(partition, claimed, generation)
        marks = [(mark.key, mark.count, mark.below) for mark in departed
                 if mark.seek_generation >= claimed.seek_generation]
        if marks:  # records of keys cleared in their new partitions are settled here (SUB-8)
            state.core.set_departed(marks)
        if waited == generation and waiting:
            state.add(waiting)
        sought = "" if claimed.seek_offset is None else f", seek {claimed.seek_generation} to {claimed.seek_offset}"
        marks_text = f", {len(claimed.cascades)} cascade marks" if claimed.cascades else ""
        if departed:
            marks_text += f", {len(marks)} departed keys"
        _LOGGER.info("%s: claimed partition %d (epoch %d, %d settled above the commit, %d handed out "
                     "before, %d of them never seen started%s%s)", self._subscription, partition, claimed.epoch,
                     len(claimed.settled), len(claimed.attempts), len(claimed.unstarted), marks_text, sought)
        return True

    def _new_state(self, partition: int, claimed: ClaimedPartition, generation: int) -> OwnedPartition:
        if claimed.seek_offset is not None:
            self._unconfirmed[partition] = (claimed.epoch, claimed.seek_generation)
            self._committed.pop(partition, None)
        policy = self._settings.dead_letter_policy
        attempts = charged_attempts(claimed, policy.max_delivery_attempts if policy is not None else None)
        state = self.owned[partition] = OwnedPartition(
            partition, claimed.epoch, ordered=self._settings.enable_message_ordering,
            settled_before=claimed.settled, attempts_before=attempts, suspects=self._suspects,
            generation=generation, start_offset=claimed.seek_offset, seek_generation=claimed.seek_generation,
            cascades=claimed.cascades, floor=claimed.floor, topic=self._settings.topic, submit=self._submit,
            acks=self._acks)
        history = self._counts_for(partition)
        if len(history) > 1:  # keys moved in by a growth wait for their old partitions (SUB-8)
            state.core.set_moves(partition, history)
        return state

    def _restart(self, partition: int, claimed: ClaimedPartition) -> None:
        """Restart an owned partition at a seek's target (GRP-3); it takes no records until the consumer
        has sought there."""
        assert claimed.seek_offset is not None
        self._new_state(partition, claimed, AWAITING_SEEK)
        self.seeks.append(SeekPartition(partition, claimed.seek_offset, claimed.seek_generation))
        _LOGGER.info("%s: partition %d sought to %d (seek %d, epoch %d, %d settled above it)", self._subscription,
                     partition, claimed.seek_offset, claimed.seek_generation, claimed.epoch, len(claimed.settled))

    # -- seeks (GRP-3) -----------------------------------------------------------------------------
    def seek_announced(self) -> int:
        """The subscription's latest seek generation announced (raises ``redis.RedisError``)."""
        return self._store.seek_announced(self._subscription)

    def apply_seeks(self) -> tuple[list[int], list[int]]:
        """Apply the seeks pending for the owned partitions (raises ``redis.RedisError``). Returns the
        partitions restarted (their deliveries of before are void) and those fenced (another owner)."""
        epochs = {number: state.epoch for number, state in self.owned.items() if not state.revoking}
        restarted, fenced = [], []
        for partition, claimed in self._store.claim_for_seek(self._subscription, epochs).items():
            if claimed is None:
                fenced.append(partition)
            else:
                self._restart(partition, claimed)
                restarted.append(partition)
        return restarted, fenced

    def sought(self, partition: int, generation: int, seek_generation: int) -> None:
        """The fetcher has sought the consumer for seek ``seek_generation``: records fetched under
        ``generation`` belong to the restarted state."""
        state = self.owned.get(partition)
        if state is not None and state.generation == AWAITING_SEEK and state.seek_generation == seek_generation:
            state.generation = generation

    def confirm(self, partition: int, seek_generation: int) -> None:
        """A commit tagged ``seek_generation`` reached Kafka: a seek of that generation applied here is
        complete; mark it applied in Redis (when Redis fails, the commit point is sent again at the next
        interval, and its report retries)."""
        entry = self._unconfirmed.get(partition)
        if entry is None or entry[1] != seek_generation:
            return
        try:
            marked = self._store.seek_applied(self._subscription, partition, *entry)
        except redis.RedisError as exc:
            _LOGGER.warning("%s: marking seek %d applied in partition %d failed (%s); retrying", self._subscription,
                            seek_generation, partition, exc)
            self._committed.pop(partition, None)
            return
        del self._unconfirmed[partition]
        if marked:
            _LOGGER.info("%s: seek %d applied in partition %d", self._subscription, seek_generation, partition)

    def take(self, fetched: Fetched) -> None:
        """Hand fetched records to the ownership they were fetched for. A record of an earlier
        generation is dropped: the partition's current owner (this subscriber again, or another)
        fetches it again from the committed offset, and taking it here would make that refetch look
        like duplicates (SUB-3)."""
        owned, unclaimed, generations = self.owned, self._unclaimed, fetched.generations
        records = fetched.records
        for partition, start, stop in partition_runs(records):  # records come in runs of one partition
            state = owned.get(partition)
            if state is not None:
                if state.generation == generations.get(partition):
                    state.add(records, start, stop)
                continue
            entry = unclaimed.get(partition)
            if entry is not None and entry[0] == generations.get(partition):
                entry[1].extend(records[start:stop])
        for partition, (generation, waiting) in list(unclaimed.items()):
            if waiting:
                self.claim(partition, generation)

    def drop(self, partition: int) -> OwnedPartition | None:
        """Forget a partition (revoked, lost or fenced)."""
        self._unclaimed.pop(partition, None)
        self._committed.pop(partition, None)
        state = self.owned.pop(partition, None)
        if state is not None:
            _LOGGER.info("%s: released partition %d", self._subscription, partition)
        return state

    def adopted(self, partition: int) -> None:
        """Redis had lost the partition's state and took this owner's epoch: store the settings again."""
        _LOGGER.warning("%s: Redis lost the state of partition %d; re-adopted it", self._subscription, partition)
        self._store.create_settings(self._subscription, self._settings)

    def buffered(self) -> int:
        """Fetched records not yet released, all partitions."""
        return sum(state.buffered for state in self.owned.values())

    def ready(self) -> int:
        """Ready keys, at most, all partitions (``OwnedPartition.ready``)."""
        return sum(state.ready for state in self.owned.values())

    def busy(self) -> int:
        """Keys with a delivery outstanding, all partitions."""
        return sum(state.core.busy for state in self.owned.values())

    def end_walks(self) -> None:
        """Let partitions still in their recovery walk release: the fetch is held over the buffer
        limit, so the walks might not end otherwise. Each marks its cascading keys in Redis first and
        holds its commit point at the marks until its walk ends, so that a successor after a crash
        cascades them from the same records (SUB-4)."""
        for state in self.owned.values():
            state.core.end_walk()

    def release(self, now: float, budget: int, per_key: int, byte_budget: int, lease_ms: int | None, *,
                pooled: bool, leases: LeaseTable | None = None, ahead: bool = False, run_share: float = 0.0,
                run_most: int = 0) -> Released:
        """Release up to ``budget`` records and ``byte_budget`` bytes, ``per_key`` per ready key, their
        attempts queued for Redis as ``lease_ms`` and ``pooled`` say, outstanding in ``leases``
        (``OwnedPartition.release_ready``; a key far behind may take ``run_share`` of its records, up
        to ``run_most``).
        Partitions take turns: each gets a fair share of the budget first, starting one further each
        call, then the rest goes round (so under flow control no partition gets freed budget first).
        ``ahead`` (pull mode, no pull waiting) skips the partitions whose claim charged attempts not
        yet settled: those records go out only to a waiting pull, their attempt written as started
        before the pull returns, so that a message that crashes its pullers is dead-lettered after
        exactly ``max_delivery_attempts`` (DLQ-3)."""
        states = [state for state in self.owned.values()
                  if not state.revoking and not (ahead and state.charged_pending())]
        if not states or budget <= 0 or byte_budget <= 0:
            return []
        self._rotation = start = (self._rotation + 1) % len(states)
        states = states[start:] + states[:start]
        for state in states:
            state.core.wake(now)
        released: Released = []
        share = max(per_key, -(-budget // len(states)))
        for cap in (share, budget):
            for state in states:
                if budget <= 0 or byte_budget <= 0:
                    return released
                if not state.ready:
                    continue  # no key ready: nothing to release
                batch, size = state.release_ready(now, min(cap, budget), per_key, byte_budget, lease_ms,
                                                  pooled=pooled, leases=leases, run_share=run_share,
                                                  run_most=run_most)
                if batch:
                    byte_budget -= size
                    budget -= len(batch)
                    released.append((state, batch))
        return released

    def commit_failed(self, partition: int) -> None:
        """The coordinator refused the partition's last commit: send its commit point again."""
        self._committed.pop(partition, None)

    def commit_offsets(self, topic: str, *, sync: bool, only: list[int] | None = None) -> list[TopicPartition]:
        """Each owned partition's lowest unsettled offset (ACK-4); without ``sync`` only those that
        moved since the last call."""
        offsets = []
        for number, state in self.owned.items():
            if only is not None and number not in only:
                continue
            watermark = state.watermark
            # An async commit is only queued for the fetch thread, which may stop before it runs:
            # the sync commits of revoke and close never trust it.
            if watermark is None or (not sync and self._committed.get(number) == watermark):
                continue
            offsets.append(TopicPartition(topic, number, watermark, metadata=seek_tag(state.seek_generation)))
            self._committed[number] = watermark
        return offsets
