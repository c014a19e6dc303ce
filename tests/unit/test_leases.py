"""Leases alone: extension before the deadline, lapse at it, maximum lease duration, tracking off."""

from __future__ import annotations

from ordering_layer.config import SubscriptionSettings
from ordering_layer.record import RecordMetadata
from ordering_layer.subscriber.leases import Leases
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
