"""Leases alone: extension before the deadline, lapse at it, maximum lease duration, tracking off."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Iterator
from typing import Any

from ordering_layer.config import SubscriptionSettings
from ordering_layer.record import RecordMetadata
from ordering_layer.subscriber.leases import Leases
from ordering_layer.subscriber.message import Message
from ordering_layer.subscriber.partition import Delivery, Record


def delivery(offset: int, size: int = 10) -> Delivery:
    record = Record(0, offset, b"k", b"x" * size, [], RecordMetadata(None, 1, None), size, 0)
    return Delivery(record, b"k", offset + 100, 1)


def test_a_held_lease_is_extended_before_its_deadline_and_lapses_after_max_lease_duration() -> None:
    """ACK-2: leases still held are extended (p99, at least 10 s) until max_lease_duration; ACK-1: then
    they lapse at their deadline and are given back."""
    leases = Leases(SubscriptionSettings(topic="t", ack_deadline=10, max_lease_duration=15))
    assert leases.admit(0, [delivery(1), delivery(2)], now=0.0) == 20
    assert leases.bytes == 20 and leases.next_check() is not None
    extended, lapsed = leases.expire(now=8.5)
    assert [(e.partition, e.offset) for e in extended] == [(0, 1), (0, 2)] and lapsed == []
    assert leases.outstanding[(0, 1)].deadline == 18.5
    extended, lapsed = leases.expire(now=17.0)  # held 17 s > 15: not extended again
    assert extended == [] and lapsed == []
    extended, lapsed = leases.expire(now=18.5)
    assert sorted(out.record.offset for out in lapsed) == [1, 2]
    assert leases.outstanding == {} and leases.bytes == 0
    assert (leases.extensions, leases.lapses) == (2, 2)


def test_a_settled_or_redeadlined_delivery_is_not_expired_by_an_old_watch() -> None:
    """ACK-3: modify_ack_deadline moves the deadline; an ack ends the lease."""
    leases = Leases(SubscriptionSettings(topic="t", ack_deadline=10))
    leases.admit(0, [delivery(1), delivery(2)], now=0.0)
    out = leases.outstanding[(0, 1)]
    leases.acked(out, now=3.0)
    leases.pop((0, 1))
    leases.set_deadline((0, 2), leases.outstanding[(0, 2)], 100.0, now=1.0)
    assert leases.expire(now=12.0) == ([], [])
    leases.take_latencies()
    assert list(leases.latencies) == [3.0] and len(leases.histogram) == 1


def test_tracking_off_watches_nothing() -> None:
    """Leases off (a comparison setting): no watch, no expiry."""
    leases = Leases(SubscriptionSettings(topic="t", ack_deadline=10), track=False)
    leases.admit(0, [delivery(1)], now=0.0)
    assert leases.next_check() is None and leases.expire(now=1000.0) == ([], [])
    assert len(leases.outstanding) == 1


def test_only_the_deliveries_a_batch_watch_still_looks_at_lapse_with_it() -> None:
    """ACK-1, ACK-3: of one released batch, an acked delivery and one given a new deadline are left out
    when the batch's watch comes due; the one still held lapses at the deadline."""
    leases = Leases(SubscriptionSettings(topic="t", ack_deadline=10, max_lease_duration=5))
    batch = [delivery(1), delivery(2), delivery(3)]
    leases.admit(0, batch, now=0.0)
    del leases.outstanding[(0, 1)]  # a plain ack, as Settlement.acks takes it out
    leases.acked_many([batch[0]], now=1.0)
    leases.set_deadline((0, 2), batch[1], 100.0, now=1.0)
    assert leases.expire(now=9.9) == ([], [])  # held past max_lease_duration: not extended
    extended, lapsed = leases.expire(now=10.0)
    assert extended == [] and lapsed == [batch[2]]
    assert list(leases.outstanding) == [(0, 2)]
    assert leases.expire(now=101.0)[1] == [batch[1]]


def test_settled_leases_leave_nothing_behind_until_their_watch_is_due() -> None:
    """A batch's watch waits in the heap for the ack deadline: once its deliveries are settled it
    holds no object per delivery, only their offsets (a busy subscriber settles ack-deadline-many
    deliveries meanwhile)."""
    leases = Leases(SubscriptionSettings(topic="t", ack_deadline=60))
    batches = [[delivery(batch * 1000 + i) for i in range(1000)] for batch in range(2)]
    for batch in batches:  # warm up: the dicts and the heap at their working size
        leases.admit(0, batch, now=0.0)
        for out in batch:
            del leases.outstanding[(0, out.record.offset)]
        leases.acked_many(batch, now=0.0)
    del batches, batch, out
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for number in range(2, 52):
            batch = [delivery(number * 1000 + i) for i in range(1000)]
            leases.admit(0, batch, now=1.0)
            for out in batch[:500]:
                del leases.outstanding[(0, out.record.offset)]
            leases.acked_many(batch[:500], now=2.0)
            for out in batch[500:]:
                leases.pop((0, out.record.offset))
            del batch, out
        leases.take_latencies()
        leases.latencies.clear()
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert leases.outstanding == {} and len(leases._heap) == 52
    # The watches' offsets, 8 bytes each (~0.4 MB); keys kept as objects took ~4.9 MB.
    assert kept < 16 * 50_000, f"{kept} bytes kept for 50,000 settled deliveries"


class _NoScan(dict[tuple[int, int], Delivery]):
    """Outstanding deliveries that refuse to be walked (lookups only)."""

    def __iter__(self) -> Iterator[tuple[int, int]]:
        raise AssertionError("the outstanding deliveries were scanned")

    def items(self) -> Any:
        raise AssertionError("the outstanding deliveries were scanned")

    def values(self) -> Any:
        raise AssertionError("the outstanding deliveries were scanned")


def test_a_due_watch_looks_up_its_own_deliveries_only() -> None:
    """ACK-1, ACK-2: a batch's watch with deliveries still held finds them by their offsets, without
    walking every outstanding delivery (many may be outstanding with slow handlers)."""
    leases = Leases(SubscriptionSettings(topic="t", ack_deadline=10, max_lease_duration=5))
    leases.outstanding = _NoScan()
    held = [delivery(offset) for offset in range(1000)]
    leases.admit(0, held[:500], now=0.0)
    leases.admit(1, held[500:], now=1.0)
    for out in held[:499]:
        leases.pop((0, out.record.offset))
    extended, lapsed = leases.expire(now=10.0)
    assert extended == [] and lapsed == [held[499]]
    assert len(leases.outstanding) == 500 and leases.expire(now=10.5) == ([], [])
    assert len(leases.expire(now=11.0)[1]) == 500


def test_a_message_has_every_field_of_a_delivery() -> None:
    """``Message`` sets ``Delivery``'s fields itself (one call fewer per message): none may be left
    unset, or the leases and settlement would fail on it."""
    base = delivery(7)
    message = Message(base.record, b"k", 3, 2, "t", 1)
    assert set(Delivery.__slots__) <= {name for name in dir(message) if hasattr(message, name)}
    assert (message.record, message.queue_key, message.token, message.attempt) == (base.record, b"k", 3, 2)
    assert (message.deadline, message.first_delivery, message.check, message.watch) == (0.0, 0.0, 0.0, None)
    leases = Leases(SubscriptionSettings(topic="t", ack_deadline=10))
    leases.admit(0, [message], now=0.0)
    assert leases.pop((0, 7)) is message and leases.bytes == 0
