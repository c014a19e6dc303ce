"""Release within flow control, admission and hand-out of one engine (``Dispatcher``), without Kafka."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, cast

from ordering_layer._core import whole_batches
from ordering_layer.config import DeadLetterPolicy, FlowControl, SubscriptionSettings
from ordering_layer.state import StateStore
from ordering_layer.state.store import OpKind, unpack_ops
from ordering_layer.subscriber.dead_letters import MAX_DELIVERY_ATTEMPTS, DeadLetters
from ordering_layer.subscriber.dispatch import Dispatcher
from ordering_layer.subscriber.flow import FlowGate
from ordering_layer.subscriber.handoff import AHEAD_AT_LEAST, PullWaiters
from ordering_layer.subscriber.leases import lease_table
from ordering_layer.subscriber.message import Message
from ordering_layer.subscriber.owned_partition import OwnedPartition
from ordering_layer.subscriber.partitions import Partitions, Released
from ordering_layer.subscriber.records import Delivery
from ordering_layer.subscriber.requests import Pull
from ordering_layer.subscriber.settlement import REQUEUE_DELAY
from ordering_layer.subscriber.state_writer import StateWriter
from tests.model.test_partition import record
from tests.unit.test_engine import FakeStore


class HeldDeadLetters(DeadLetters):
    """Dead letters kept here instead of produced."""

    def __init__(self, settings: SubscriptionSettings) -> None:
        super().__init__({"bootstrap.servers": "127.0.0.1:1"}, cast(StateStore, FakeStore()), "sub", settings,
                         lambda report: None)
        self.held: list[tuple[int, int, str]] = []

    def write(self, delivery: Delivery, epoch: int, reason: str) -> None:
        self.held.append((delivery.record.offset, epoch, reason))


class Rig:
    """Partition 0 owned with records 0..5 of keys a, b, a, b, c, c; callback mode unless ``pull``."""

    def __init__(self, *, pull: bool = False, max_messages: int = 1000,
                 settings: SubscriptionSettings | None = None) -> None:
        self.settings = settings or SubscriptionSettings(topic="t")
        store = cast(StateStore, FakeStore())
        self.posted: list[Any] = []
        self.owned = Partitions(store, "sub", self.settings, submit=self.posted.append)
        assert self.owned.claim(0, 1)
        keys = [b"a", b"b", b"a", b"b", b"c", b"c"]
        self.owned.owned[0].add([record(offset, key) for offset, key in enumerate(keys)])
        self.leases = lease_table(self.settings)
        self.writer = StateWriter(store, "sub")
        self.pulls = PullWaiters()
        self.dead_letters = HeldDeadLetters(self.settings)
        self.counts = {"delivered": 0, "redelivered": 0}
        self.handed: list[Message] = []
        self.given_back: list[int] = []
        self.held_for: set[float] = set()  # the delays given back deliveries' keys were held
        on_messages: Callable[[list[Message]], None] | None = None if pull else self.handed.extend
        self.dispatcher = Dispatcher(self.settings, self.owned, FlowGate(FlowControl(max_messages=max_messages)),
                                     self.leases, self.writer, self.pulls, self.dead_letters, self.counts,
                                     on_messages, self.give_back)

    def give_back(self, released: Released, now: float, delay: float) -> None:
        self.given_back.extend(m.record.offset for _, batch in released for m in batch)
        self.held_for.add(delay)


def test_callback_mode_releases_one_per_key_within_the_budget_and_queues_released_attempts() -> None:
    """SUB-1, SUB-7, ACK-6: one record per ready key, no more than the flow-control budget; each becomes
    outstanding and its attempt is queued as released (in the pool); no lease is written with it."""
    rig = Rig(max_messages=2)
    released = rig.dispatcher.release(0.0)
    [(state, batch)] = released
    assert state is rig.owned.owned[0]
    assert [d.record.offset for d in batch] == [0, 1]
    assert rig.leases.count == 2 and all(rig.leases.holds(d.lease) for d in batch)
    assert rig.writer.count == 2
    assert unpack_ops(state.take_ops()) == [(OpKind.FIRST_RELEASED, 0, 1), (OpKind.FIRST_RELEASED, 1, 1)]
    assert rig.dispatcher.release(0.0) == []  # the budget is used up
    rig.dispatcher.hand_out(released)
    assert [(m.offset(), m.ordering_key) for m in rig.handed] == [(0, "a"), (1, "b")]
    assert rig.counts == {"delivered": 2, "redelivered": 0}
    rig.handed[0].ack()
    assert rig.posted == [rig.handed[0]]  # acks go to the engine's inbox


def test_pull_mode_releases_per_key_batches_only_for_a_waiting_pull() -> None:
    """SUB-1, GRP-5: nothing is released while no pull waits; then whole per-key batches up to the pull's
    size, queued as delivered (user code has them), answer the oldest pull."""
    rig = Rig(pull=True)
    assert rig.dispatcher.release(0.0) == []
    future: Future[list[Message]] = Future()
    rig.dispatcher.pull(Pull(3, time.monotonic() + 10, future), 0.0)
    released = rig.dispatcher.release(0.0)
    assert [d.record.offset for _, batch in released for d in batch] == [0, 2, 1]
    assert {op[0] for op in unpack_ops(rig.owned.owned[0].take_ops())} == {OpKind.FIRST_DELIVERED}
    rig.dispatcher.hand_out(released)
    assert [m.offset() for m in future.result(0)] == [0, 2, 1]


def test_pull_mode_releases_ahead_of_the_next_pull_which_is_answered_at_once() -> None:
    """GRP-5, ACK-6, SUB-7: once a pull was answered and none waits, up to its size is released ahead
    within flow control, queued as released (no user code has them yet); once out they answer the
    next pull at once, and the waiting pulls keep them for the coordinator to note their starts."""
    rig = Rig(pull=True, max_messages=4)
    first: Future[list[Message]] = Future()
    rig.dispatcher.pull(Pull(3, time.monotonic() + 10, first), 0.0)
    rig.dispatcher.hand_out(rig.dispatcher.release(0.0))
    assert [m.offset() for m in first.result(0)] == [0, 2, 1]
    state = rig.owned.owned[0]
    state.take_ops()
    ahead = rig.dispatcher.release(0.0)
    assert [d.record.offset for _, batch in ahead for d in batch] == [4]  # the flow-control budget: 4
    assert {op[0] for op in unpack_ops(state.take_ops())} == {OpKind.FIRST_RELEASED}
    assert rig.dispatcher.release(0.0) == []
    rig.dispatcher.hand_out(ahead)
    assert rig.pulls.take_served() == []
    second: Future[list[Message]] = Future()
    rig.dispatcher.pull(Pull(3, time.monotonic() + 10, second), 0.0)
    assert [m.offset() for m in second.result(0)] == [4]
    assert [m.offset() for m in rig.pulls.take_served()] == [4] and rig.pulls.take_served() == []


def test_messages_released_ahead_are_given_back_uncounted_when_withdrawn() -> None:
    """ACK-6, SUB-5: messages released ahead and not pulled go back to their keys (a key's last first,
    each rewound alone) with their attempt taken back, when their partition is revoked or the
    engine closes."""
    rig = Rig(pull=True)
    rig.dispatcher.pull(Pull(1, time.monotonic() + 10, Future()), 0.0)
    rig.dispatcher.hand_out(rig.dispatcher.release(0.0))
    rig.dispatcher.hand_out(rig.dispatcher.release(0.0))
    rig.dispatcher.withdraw([1])
    assert rig.given_back == []
    rig.dispatcher.withdraw()
    # Every message released ahead (a key's last first), none pulled: nothing failed, no key is held.
    assert rig.given_back == [4, 1] and rig.held_for == {0.0}


def test_a_partition_with_charged_attempts_is_not_released_ahead_until_they_settle() -> None:
    """DLQ-3, ACK-6: a claimed partition whose earlier owner left deliveries unsettled releases only to
    a waiting pull (their attempts written as started before the pull returns) until its commit
    point passes the last charged record; then it is released ahead too."""
    rig = Rig(pull=True)
    store = cast(StateStore, FakeStore())
    charged = Partitions(store, "sub", rig.settings, submit=rig.posted.append)
    assert charged.claim(0, 1)
    state = charged.owned[0]
    replaced = OwnedPartition(0, 2, ordered=True, attempts_before={0: 1}, suspects=False)
    replaced.add([record(offset, key) for offset, key in enumerate([b"a", b"b"])])
    charged.owned[0] = replaced
    assert replaced.charged_pending() and not state.charged_pending()
    assert charged.release(0.0, 10, 10, 10**9, None, pooled=True, ahead=True) == []
    [(_, batch)] = charged.release(0.0, 10, 10, 10**9, None, pooled=False)
    assert [d.record.offset for d in batch] == [0, 1] and [d.attempt for d in batch] == [2, 1]
    replaced.core.ack_one(0, batch[0].token)
    assert not replaced.charged_pending()


def test_a_pull_whose_release_was_given_back_waits_again_for_the_next_release() -> None:
    """DLQ-3, SUB-1 (pull mode): a release claims the oldest pull; when Redis did not take its attempts
    the deliveries go back unseen and the pull waits again, first in line, to be answered by the next
    release whose flush succeeded."""
    rig = Rig(pull=True)
    future: Future[list[Message]] = Future()
    rig.dispatcher.pull(Pull(3, time.monotonic() + 10, future), 0.0)
    released = rig.dispatcher.release(0.0)
    assert rig.pulls.wanted() == (AHEAD_AT_LEAST, False)  # claimed: the next release is ahead of the next pull
    rig.dispatcher.deliver(released, False)
    assert rig.given_back == [0, 2, 1] and not future.done() and rig.pulls.wanted() == (3, True)
    assert rig.held_for == {REQUEUE_DELAY}  # the write is tried again a little later
    rig.pulls.claim(3, True)
    rig.dispatcher.deliver(released, True)
    assert [m.offset() for m in future.result(0)] == [0, 2, 1]


def test_hand_out_skips_a_partition_fenced_meanwhile_and_counts_redeliveries() -> None:
    """ACK-5, SUB-4: deliveries of a partition state replaced since their release (fenced by the flush that
    recorded them) are not handed out; attempts above 1 count as redeliveries."""
    rig = Rig()
    released = rig.dispatcher.release(0.0)
    rig.owned.owned[0] = OwnedPartition(0, 2, ordered=True)
    rig.dispatcher.hand_out(released)
    assert rig.handed == [] and rig.counts["delivered"] == 0
    rig.owned.owned[0] = released[0][0]
    retried = Message(record(9, b"z"), b"z", 1, 2, "t", 1, rig.posted.append)
    rig.dispatcher.hand_out([(released[0][0], [retried])])
    assert [m.delivery_attempt for m in rig.handed] == [2] and rig.counts["redelivered"] == 1


def test_deliveries_beyond_the_attempt_limit_are_dead_lettered_not_handed_out() -> None:
    """DLQ-2, DLQ-3: a delivery whose attempt exceeds ``max_delivery_attempts`` goes to the dead-letter
    writer under its epoch; the others reach user code."""
    settings = SubscriptionSettings(topic="t", dead_letter_policy=DeadLetterPolicy("dlq", max_delivery_attempts=5))
    rig = Rig(settings=settings)
    state = rig.owned.owned[0]
    rig.dispatcher.hand_out([(state, [Message(record(0, b"a"), b"a", 1, 6, "t", 1, rig.posted.append),
                                      Message(record(1, b"b"), b"b", 2, 5, "t", 1, rig.posted.append)])])
    assert rig.dead_letters.held == [(0, 1, MAX_DELIVERY_ATTEMPTS)]
    assert [m.offset() for m in rig.handed] == [1]


def test_a_pull_takes_whole_key_batches_of_compiled_messages_read_through_the_lease_table() -> None:
    """SUB-1, GRP-5 (pull mode): ``whole_batches`` reads the released messages' fields and the lease
    table without Python: whole per-key batches in release order up to the room, stopping at the
    first batch that does not fit; a batch head whose lease is gone is passed over (looked at, not
    taken), the rest of its key's batch then forms a batch of its own. A callable ``holds`` gives the
    same answers."""
    rig = Rig(pull=True)
    rig.dispatcher.pull(Pull(6, time.monotonic() + 10, Future()), 0.0)
    messages = [message for _, batch in rig.dispatcher.release(0.0) for message in batch]
    assert [m.offset() for m in messages] == [0, 2, 1, 3, 4, 5]
    for holds in (rig.leases, rig.leases.holds):
        assert whole_batches(messages, 3, holds) == (messages[:2], 2)  # b's batch of 2 does not fit in 1
        assert whole_batches(messages, 4, holds) == (messages[:4], 4)
        assert whole_batches(messages, 6, holds) == (messages, 6)
        assert whole_batches(messages, 1, holds) == ([], 0)
    rig.leases.pop(messages[2].lease, 0.0)  # key b's head settled
    for holds in (rig.leases, rig.leases.holds):
        assert whole_batches(messages, 6, holds) == ([messages[0], messages[1], *messages[3:]], 6)
        assert whole_batches(messages, 3, holds) == ([messages[0], messages[1], messages[3]], 4)
        assert whole_batches(messages, 2, holds) == (messages[:2], 3)  # c's batch stops the scan
    assert whole_batches([], 5, rig.leases) == ([], 0)


def test_callback_mode_gives_a_key_far_behind_a_longer_run_within_the_budget() -> None:
    """SUB-1, SUB-7 (skewed keys): a key whose records are much of those buffered may take as much of
    the flow-control limit as its part of them (up to ``RUN_MAX``), as one run, instead of the even
    share of the keys at work; the others keep theirs, and the budget holds."""
    rig = Rig(max_messages=40)
    rig.owned.owned[0].add([record(offset, b"h") for offset in range(6, 66)])  # 60 records of h
    released = rig.dispatcher.release(0.0)
    messages = [message for _, batch in released for message in batch]
    by_key: dict[bytes, list[int]] = {}
    for message in messages:
        by_key.setdefault(cast(bytes, message.queue_key), []).append(message.offset())
    # Four keys at work: an even share is 10 each; h has 60 of the 66 buffered records: 40 * 60 / 66
    # = 36 of them, cut to the 34 the budget has left after a, b and c.
    assert by_key == {b"a": [0, 2], b"b": [1, 3], b"c": [4, 5], b"h": list(range(6, 40))}
    assert len(messages) == rig.leases.count == 40
