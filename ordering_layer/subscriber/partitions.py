"""Ownership of partitions: claims, the recovery walk's inputs, and assignment generations.

A partition assigned to this subscriber is claimed in Redis (a new owner epoch, ACK-5; the offsets
settled above the committed offset and the attempt counts, for the recovery walk of SUB-3/SUB-4 and
ACK-6) and gets a ``PartitionState`` tagged with the assignment generation it was claimed under.
Fetched records reach a partition's state only when they were fetched under that same generation:
records fetched for an ownership that has ended are dropped, the current owner refetches them from
the committed offset (SUB-3). A claim that fails (Redis down) keeps the partition's records waiting
and is retried when more of them arrive.
"""

from __future__ import annotations

import logging

import redis
from confluent_kafka import TopicPartition

from ordering_layer.config import SubscriptionSettings
from ordering_layer.state import ClaimedPartition, StateStore
from ordering_layer.subscriber.partition import Delivery, PartitionState, Record
from ordering_layer.subscriber.requests import Fetched

_LOGGER = logging.getLogger(__name__)


def charged_attempts(claimed: ClaimedPartition, max_attempts: int | None) -> dict[int, int]:
    """The delivery attempts each unsettled offset of a claimed partition is charged with (ACK-6,
    DLQ-3); its next delivery is the attempt after that.

    An attempt that user code started (a pull handed it out, or a callback worker recorded its
    start) counts in full: its owner may have crashed on it. An attempt still waiting in a callback
    pool when its owner went may never have reached user code, or its start mark was lost with the
    owner: it counts, but never up to ``max_attempts``, so that a message is dead-lettered only
    after an attempt whose start is recorded. The new owner records the start of a suspect's every
    delivery before user code runs (``Engine.begin``), so a message that crashes every process it
    runs in is dead-lettered after exactly ``max_attempts`` deliveries, and one that merely waited
    beside it is never dead-lettered for those crashes.

    Args:
        claimed: what the claim read.
        max_attempts: the dead-letter policy's ``max_delivery_attempts``; None without a policy.
    """
    if max_attempts is None or not claimed.unstarted:
        return dict(claimed.attempts)
    unstarted, ceiling = claimed.unstarted, max_attempts - 1
    # Beyond max_attempts the attempt was on its way to the dead-letter topic, not to user code.
    return {offset: min(n, ceiling) if offset in unstarted and n <= max_attempts else n
            for offset, n in claimed.attempts.items()}


class Partitions:
    """The partitions one engine owns (used under the engine's lock).

    Args:
        store: the Redis state store (claims).
        subscription: subscription name.
        settings: the subscription's settings (ordering on or off; stored again after a Redis loss).
    """

    def __init__(self, store: StateStore, subscription: str, settings: SubscriptionSettings) -> None:
        self._store = store
        self._subscription = subscription
        self._settings = settings
        self.owned: dict[int, PartitionState] = {}
        self._unclaimed: dict[int, tuple[int, list[Record]]] = {}  # generation, records waiting
        self._committed: dict[int, int] = {}  # the last commit point queued or made per partition
        self._rotation = 0

    def claim(self, partition: int, generation: int) -> bool:
        """Claim a partition assigned under ``generation``; False when Redis failed (retried later)."""
        try:
            claimed = self._store.claim(self._subscription, partition)
        except redis.RedisError as exc:
            _LOGGER.warning("claiming partition %d of %s failed (%s); retrying", partition, self._subscription, exc)
            entry = self._unclaimed.get(partition)
            if entry is None or entry[0] != generation:
                self._unclaimed[partition] = (generation, [])
            return False
        policy = self._settings.dead_letter_policy
        attempts = charged_attempts(claimed, policy.max_delivery_attempts if policy is not None else None)
        state = self.owned[partition] = PartitionState(
            partition, claimed.epoch, ordered=self._settings.enable_message_ordering,
            settled_before=claimed.settled, attempts_before=attempts, generation=generation)
        waited, waiting = self._unclaimed.pop(partition, (generation, []))
        if waited == generation:
            for record in waiting:
                state.add(record)
        _LOGGER.info("%s: claimed partition %d (epoch %d, %d settled above the commit, %d handed out "
                     "before, %d of them never seen started)", self._subscription, partition, claimed.epoch,
                     len(claimed.settled), len(claimed.attempts), len(claimed.unstarted))
        return True

    def take(self, fetched: Fetched) -> None:
        """Hand fetched records to the ownership they were fetched for. A record of an earlier
        generation is dropped: the partition's current owner (this subscriber again, or another)
        fetches it again from the committed offset, and taking it here would make that refetch look
        like duplicates (SUB-3)."""
        owned, unclaimed, generations = self.owned, self._unclaimed, fetched.generations
        state: PartitionState | None = None
        current = -1
        take = None
        for record in fetched.records:
            partition = record.partition
            if partition != current:  # records come in runs of one partition
                current = partition
                state = owned.get(partition)
                take = state.add if state is not None and state.generation == generations.get(partition) else None
            if take is not None:
                take(record)
            elif state is None:
                entry = unclaimed.get(partition)
                if entry is not None and entry[0] == generations.get(partition):
                    entry[1].append(record)
        for partition, (generation, waiting) in list(unclaimed.items()):
            if waiting:
                self.claim(partition, generation)

    def drop(self, partition: int) -> PartitionState | None:
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

    def release(self, now: float, budget: int, per_key: int,
                byte_budget: int) -> list[tuple[PartitionState, list[Delivery]]]:
        """Release up to ``budget`` records and ``byte_budget`` bytes, ``per_key`` per ready key.
        Partitions take turns: each gets a fair share of the budget first, starting one further each
        call, then the rest goes round (so under flow control no partition gets freed budget first)."""
        states = [state for state in self.owned.values() if not state.revoking]
        if not states or budget <= 0 or byte_budget <= 0:
            return []
        self._rotation = start = (self._rotation + 1) % len(states)
        states = states[start:] + states[:start]
        for state in states:
            state.wake(now)
        released: list[tuple[PartitionState, list[Delivery]]] = []
        share = max(per_key, -(-budget // len(states)))
        for cap in (share, budget):
            for state in states:
                if budget <= 0 or byte_budget <= 0:
                    return released
                batch = state.release_ready(now, min(cap, budget), per_key, byte_budget)
                if batch:
                    byte_budget -= sum(delivery.record.size for delivery in batch)
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
            watermark = state.tracker.watermark
            # An async commit is only queued for the fetch thread, which may stop before it runs:
            # the sync commits of revoke and close never trust it.
            if watermark is None or (not sync and self._committed.get(number) == watermark):
                continue
            offsets.append(TopicPartition(topic, number, watermark))
            self._committed[number] = watermark
        return offsets
