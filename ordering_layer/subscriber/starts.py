"""The starts of deliveries (ACK-6, DLQ-3): when an attempt is known to have reached user code.

A callback worker calls ``begin`` before user code runs on a message. The start of a suspect (a
record an earlier owner handed out and never settled, see ``partitions``) is written to Redis first,
outside the coordinator's lock, so that a crash in user code counts the attempt in full. Under a
dead-letter policy any other start is noted (``Settlement.starts``) and written with the
coordinator's next flush, as are the starts of the messages a pull took from those released ahead
of it (``note``). Without a policy nothing is noted: a start only keeps an attempt that went out
unseen from being charged up to the dead-letter limit (``partitions.charged_attempts``).
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from ordering_layer.config import SubscriptionSettings
from ordering_layer.state import ApplyResult, StateStore
from ordering_layer.state.store import OpKind
from ordering_layer.subscriber.message import Message
from ordering_layer.subscriber.ownership import Ownership
from ordering_layer.subscriber.partitions import Partitions
from ordering_layer.subscriber.records import Delivery
from ordering_layer.subscriber.settlement import Settlement

_LOGGER = logging.getLogger(__name__)


class Starts:
    """The start notes and suspect starts of one engine.

    Args:
        subscription: the subscription (named in the Redis writes and the log).
        settings: its settings (whether it has a dead-letter policy).
        lock: the coordinator's lock.
        store: the Redis state store (a suspect's start is written straight to it).
        owned: the owned partitions.
        settlement: where starts are noted, and deliveries held or given back.
        ownership: told of a fenced partition.
    """

    def __init__(self, subscription: str, settings: SubscriptionSettings, lock: threading.RLock,
                 store: StateStore, owned: Partitions, settlement: Settlement, ownership: Ownership) -> None:
        self._subscription = subscription
        self.notes = settings.dead_letter_policy is not None
        self._lock = lock
        self._store = store
        self._owned = owned
        self._settlement = settlement
        self._started = settlement.starts  # appended per message by the workers: no layer between
        self._ownership = ownership

    def begin(self, message: Message) -> bool:
        """A worker is about to run user code on ``message`` (any worker thread).

        A suspect's start is written to Redis before this returns; under a dead-letter policy any
        other start is noted. Returns False when user code must not run: the delivery was given
        back or its partition moved meanwhile (its redelivery is on its way), or Redis did not take
        the start (the message is given back without counting a failure).
        """
        if not message.suspect:
            if self.notes:
                self._started.append(message)
            return True
        return self._begin_suspect(message, message._epoch)

    def note(self, served: list[Message]) -> None:
        """Note the starts of messages a pull took from those released ahead (the coordinator, at the
        end of a step: written after the next step's events, so that those settled by then write none)."""
        if served and self.notes:
            self._started.extend(served)

    def _begin_suspect(self, delivery: Delivery, epoch: int) -> bool:
        record = delivery.record
        partition, offset = record.partition, record.offset
        settlement = self._settlement
        with self._lock:
            if not settlement.holds(delivery, epoch):
                return False
        # The write is made outside the lock (a Redis outage must not stall the coordinator). It
        # cannot pass a settle of this delivery (user code has not run), and the fence stops it
        # once the partition moved; only a lapse meanwhile could come first, checked below.
        try:
            [result] = self._store.apply_many(
                [(self._subscription, partition, epoch, [(OpKind.STARTED, offset, delivery.attempt)])])
        except redis.RedisError as exc:
            _LOGGER.warning("%s: recording the start of %d:%d failed (%s); redelivering it",
                            self._subscription, partition, offset, exc)
            with self._lock:
                if settlement.holds(delivery, epoch):
                    settlement.give_back([(self._owned.owned[partition], [delivery])], time.monotonic())
            return False
        with self._lock:
            if result == ApplyResult.FENCED:
                state = self._owned.owned.get(partition)
                if state is not None and state.epoch == epoch:
                    self._ownership.fenced(partition)
                return False
            if result == ApplyResult.ADOPTED:
                self._owned.adopted(partition)
            return settlement.holds(delivery, epoch)
