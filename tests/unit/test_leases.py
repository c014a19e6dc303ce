"""The lease table alone: extension before the deadline, lapse at it, maximum lease duration, tracking
off, stale handles, the p99 extension; and a run of acks settled in the partitions' cores."""

from __future__ import annotations

from ordering_layer.config import SubscriptionSettings
from ordering_layer.record import RecordMetadata
from ordering_layer.state.store import OpKind, unpack_ops
from ordering_layer.subscriber.leases import LeaseTable, lease_table
from ordering_layer.subscriber.message import Message
from ordering_layer.subscriber.owned_partition import OwnedPartition
from ordering_layer.subscriber.records import Delivery, Record


def table(ack_deadline: float = 10, max_lease_duration: float = 3600, *, track: bool = True,
          min_extension: float = 0, max_extension: float = 0) -> LeaseTable:
    return lease_table(SubscriptionSettings(topic="t", ack_deadline=ack_deadline, max_lease_duration=max_lease_duration,
                                            min_duration_per_lease_extension=min_extension,
                                            max_duration_per_lease_extension=max_extension), track=track)


def admit(leases: LeaseTable, offsets: list[int], now: float, *, partition: int = 0, size: int = 10) -> list[int]:
    return leases.admit(partition, 1, offsets, [offset + 100 for offset in offsets], [size] * len(offsets), now)


def test_a_held_lease_is_extended_before_its_deadline_and_lapses_after_max_lease_duration() -> None:
    """ACK-2: leases still held are extended (p99, at least 10 s) until max_lease_duration; ACK-1: then
    they lapse at their deadline and are given back."""
    leases = table(ack_deadline=10, max_lease_duration=15)
    first, second = admit(leases, [1, 2], now=0.0)
    assert leases.bytes == 20 and leases.count == 2 and leases.next_check() is not None
    extended, lapsed = leases.expire(now=8.5)
    assert [(p, o) for p, o, _ in extended] == [(0, 1), (0, 2)] and lapsed == []
    assert leases.deadline_of(first) == 18.5
    extended, lapsed = leases.expire(now=17.0)  # held 17 s > 15: not extended again
    assert extended == [] and lapsed == []
    extended, lapsed = leases.expire(now=18.5)
    assert sorted(lapsed) == [(0, 1, 101), (0, 2, 102)]
    assert leases.count == 0 and leases.bytes == 0 and not leases.holds(second)
    assert (leases.extensions, leases.lapses) == (2, 2)


def test_a_settled_or_redeadlined_delivery_is_not_expired_by_an_old_watch() -> None:
    """ACK-3: modify_ack_deadline moves the deadline; an ack ends the lease and feeds its latency."""
    leases = table()
    first, second = admit(leases, [1, 2], now=0.0)
    assert leases.pop(first, 3.0)
    assert leases.set_deadline(second, 100.0, now=1.0) is not None
    assert leases.expire(now=12.0) == ([], [])
    assert leases.deadline_of(second) == 101.0
    assert leases.take_latencies() == [3.0] and leases.take_latencies() == []


def test_tracking_off_watches_nothing() -> None:
    """Leases off (a comparison setting): no watch, no expiry."""
    leases = table(track=False)
    admit(leases, [1], now=0.0)
    assert leases.next_check() is None and leases.expire(now=1000.0) == ([], [])
    assert leases.count == 1


def test_only_the_deliveries_a_batch_watch_still_looks_at_lapse_with_it() -> None:
    """ACK-1, ACK-3: of one released batch, an acked delivery and one given a new deadline are left out
    when the batch's watch comes due; the one still held lapses at the deadline."""
    leases = table(ack_deadline=10, max_lease_duration=5)
    acked, redeadlined, held = admit(leases, [1, 2, 3], now=0.0)
    leases.pop(acked, 1.0)
    leases.set_deadline(redeadlined, 100.0, now=1.0)
    assert leases.expire(now=9.9) == ([], [])  # held past max_lease_duration: not extended
    assert leases.expire(now=10.0) == ([], [(0, 3, 103)])
    assert not leases.holds(held) and leases.holds(redeadlined) and leases.count == 1
    assert leases.expire(now=101.0)[1] == [(0, 2, 102)]


def test_a_handle_names_nothing_once_its_delivery_is_gone() -> None:
    """ACK-5: a handle kept after its delivery was settled, given back or dropped with its partition
    names nothing, not even a later delivery of the same offset; dropping a partition leaves the
    others."""
    leases = table()
    [old] = admit(leases, [7], now=0.0)
    assert leases.pop(old) and not leases.pop(old)
    [new] = admit(leases, [7], now=1.0)
    assert new != old and not leases.holds(old) and leases.find(0, 7) == new
    assert leases.lease_of(new) == (0, 1, 7, 107) and leases.lease_of(old) is None
    admit(leases, [1, 2], now=1.0, partition=1)
    assert leases.count_in([1]) == 2 and leases.count_in([0, 1]) == 3
    leases.drop_partition(0)
    assert not leases.holds(new) and leases.count == 2 and leases.per_partition(2.0) == {1: (2, 1.0)}


def test_settled_leases_leave_nothing_behind() -> None:
    """A busy subscriber settles ack-deadline-many deliveries while their batches' watches wait in the
    heap: the table reuses the slots and watches of settled ones instead of growing."""
    leases = table(ack_deadline=60)
    for number in range(50):
        handles = admit(leases, list(range(number * 1000, number * 1000 + 1000)), now=float(number))
        for handle in handles:
            leases.pop(handle, float(number) + 0.5)
        leases.expire(now=float(number) + 60)
    slots, watches = leases.allocated()
    assert leases.count == 0 and slots == 1000 and watches <= 60


def test_the_extension_is_the_p99_ack_latency_clamped() -> None:
    """ACK-2: latencies count in whole seconds within 10..600; an extension lasts the p99 (10 s with
    none observed), clamped to min/max_duration_per_lease_extension (0 means unset)."""
    def extension(leases: LeaseTable) -> float:
        [handle] = admit(leases, [999], now=1000.0)
        extended, _ = leases.expire(now=1009.9)
        assert len(extended) == 1
        deadline = leases.deadline_of(handle)
        assert deadline is not None
        return round(deadline - 1009.9, 6)

    assert extension(table()) == 10
    leases = table()
    for latency in [0.2] * 98 + [42.1, 5000]:
        [handle] = admit(leases, [1], now=0.0)
        leases.pop(handle, latency)
    assert (leases.percentile(50), leases.percentile(99), leases.percentile(100)) == (10, 43, 600)
    assert extension(leases) == 43
    for bounds, expected in [((0, 0), 100), ((0, 30), 30), ((200, 0), 200)]:
        slow = table(min_extension=bounds[0], max_extension=bounds[1])
        for _ in range(100):
            [handle] = admit(slow, [1], now=0.0)
            slow.pop(handle, 100.0)
        assert extension(slow) == expected
    fast = table(min_extension=20)
    [handle] = admit(fast, [1], now=0.0)
    fast.pop(handle, 1.0)
    assert extension(fast) == 20


def test_a_run_of_acks_settles_in_the_partitions_cores() -> None:
    """ACK-4, ACK-5: ``ack_run`` settles each delivery still outstanding under its partition's epoch in
    that partition's core (its SETTLED op queued, in order), and nothing for a stale handle, a
    partition owned under another epoch or one not owned; ``write_starts`` queues STARTED only for
    deliveries still outstanding."""
    leases = table()
    owned = {p: OwnedPartition(p, 1, ordered=True) for p in (0, 1)}
    for p, state in owned.items():
        state.add([Record(p, o, b"k%d" % o, b"x", None, RecordMetadata(None, 1, None), 1, 0) for o in range(3)])
    released = {p: state.release_ready(0.0, 10, 1, 10**6, None, pooled=True, leases=leases)[0]
                for p, state in owned.items()}
    assert leases.count == 6
    for state in owned.values():
        state.take_ops()
    a, b, c = released[0]
    d, e, f = released[1]
    leases.pop(c.lease)  # given back: its ack is stale
    assert leases.write_starts([b, c], owned, OpKind.STARTED) == 1
    owned[1].epoch = 2  # partition 1 claimed again meanwhile: its deliveries' acks are refused
    assert leases.ack_run([b, a, c, d, a], owned, now=1.0) == 2
    # SETTLED 1: no lease of these deliveries was written, so none is deleted; with 2 (0's only
    # attempt is in a first-attempt run, 1's start is a field) no attempts field either.
    assert unpack_ops(owned[0].take_ops()) == [(OpKind.STARTED, 1, 1), (OpKind.SETTLED, 1, 1), (OpKind.SETTLED, 0, 3)]
    assert owned[1].take_ops() == "" and leases.count == 3 and leases.holds(d.lease)
    del owned[1]
    assert leases.ack_run([e, f], owned, now=1.0) == 0 and leases.count == 3


def test_leases_reach_redis_only_for_deliveries_still_outstanding_when_due() -> None:
    """ACK-4: a release queues the attempts only; as a flush begins (``write_leases``) the deliveries
    released before the given time that are still outstanding get their LEASE op, under their
    partition's epoch; an ack settles with SETTLED 2 (its lease deleted, its attempt in a first-attempt
    run) when its lease was written, SETTLED 3 when not; a manual deadline writes the lease itself."""
    leases = table()
    owned = {0: OwnedPartition(0, 1, ordered=True)}
    state = owned[0]
    state.add([Record(0, o, b"k%d" % o, b"x", None, RecordMetadata(None, 1, None), 1, 0) for o in range(4)])
    batch, _ = state.release_ready(0.0, 10, 1, 10**6, 5_000, pooled=True, leases=leases)
    assert unpack_ops(state.take_ops()) == [(OpKind.FIRST_RELEASED, o, 1) for o in range(4)]
    assert leases.write_leases(owned, -0.1) == 0 and leases.next_lease_write() == 0.0  # not due yet
    a, b, c, _ = batch
    assert leases.ack_run([a], owned, now=0.1) == 1
    assert leases.set_deadline(b.lease, 30.0, 0.1) is not None  # the caller queues this LEASE op
    assert leases.write_leases(owned, 0.0) == 2  # due: c and d are still outstanding
    assert unpack_ops(state.take_ops()) == [(OpKind.SETTLED, 0, 3), (OpKind.LEASE, 2, 5_000), (OpKind.LEASE, 3, 5_000)]
    assert leases.next_lease_write() is None and leases.write_leases(owned, 1.0) == 0
    assert leases.ack_run([b, c], owned, now=0.2) == 2
    assert unpack_ops(state.take_ops()) == [(OpKind.SETTLED, 1, 2), (OpKind.SETTLED, 2, 2)]
    state.epoch = 2  # claimed again: its leases are no longer written here
    leases.admit(0, 1, [4], [1], [1], 0.3, lease_ms=6_000)
    assert leases.write_leases(owned, 0.3) == 0 and state.take_ops() == ""


def test_a_message_has_every_field_of_a_delivery() -> None:
    """A ``Message`` made in Python is a ``Delivery`` with every field set, as the core makes them."""
    record = Record(0, 7, b"k", b"x", [], RecordMetadata(None, 1, None), 1, 0)
    message = Message(record, b"k", 3, 2, "t", 1, lease=5)
    assert isinstance(message, Delivery) and (message._topic, message._epoch, message.settled) == ("t", 1, False)
    assert (message.record, message.queue_key, message.token, message.attempt, message.lease) == (record, b"k", 3, 2, 5)
