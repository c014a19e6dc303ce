"""Records and messages made by the core without running ``__init__`` (``core/src/slots.rs``,
``core/src/delivery.rs``, ``PartitionCore.release_messages``): the same objects as the classes make,
freed as they are."""

from __future__ import annotations

import gc
import sys
import weakref
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import Any, cast

import pytest

from ordering_layer._core import (
    RECORD_FIELDS,
    Deliveries,
    LeaseTable,
    PartitionCore,
    SlotLayout,
    partition_runs,
)
from ordering_layer.record import RecordMetadata
from ordering_layer.subscriber.message import NACKED, Message
from ordering_layer.subscriber.owned_partition import RECORD_LAYOUT, OwnedPartition
from ordering_layer.subscriber.records import Record

_META = RecordMetadata(None, 1, None)


class Held:
    """A value whose release is observable."""


class Base:
    __slots__ = ("a",)
    a: object


class Pair(Base):
    __slots__ = ("b", "c")
    b: object
    c: object

    def __init__(self) -> None:
        raise AssertionError("__init__ must not run")


def test_a_layout_fills_the_named_slots_of_a_class_and_its_bases_without_running_init() -> None:
    layout = SlotLayout(Pair, ["c", "a", "b"])
    first, second, third = Held(), Held(), Held()
    before = sys.getrefcount(first)
    pair = layout.new_instance(first, second, third)
    assert type(pair) is Pair
    assert (pair.c, pair.a, pair.b) == (first, second, third)
    assert sys.getrefcount(first) == before + 1  # one reference, held by the slot
    watched = weakref.ref(first)
    del pair, first
    assert watched() is None  # the instance let go of its values when freed
    with pytest.raises(TypeError):
        layout.new_instance(1, 2)  # a value per named slot


def test_an_unnamed_slot_is_left_empty() -> None:
    pair = SlotLayout(Pair, ["a"]).new_instance(1)
    assert pair.a == 1
    with pytest.raises(AttributeError):
        _ = pair.b


def test_a_class_that_is_not_a_plain_slot_holder_is_refused() -> None:
    class Open:
        pass

    with pytest.raises(TypeError):
        SlotLayout(Open, [])  # instances have a __dict__
    with pytest.raises(TypeError):
        SlotLayout(Pair, ["a", "d"])  # no such slot
    with pytest.raises(TypeError):
        SlotLayout(Pair, ["a", "a"])  # one slot named twice


@dataclass(slots=True)
class Twin:
    x: int
    y: bytes


def test_a_made_record_is_the_one_the_class_makes() -> None:
    values = (3, 17, b"k", b"value", [("h", b"1")], _META, 5, 1_700_000_000_000, 0, None, False, False)
    made, called = RECORD_LAYOUT.new_instance(*values), Record(*values[:8])
    assert type(made) is Record
    assert [getattr(made, f.name) for f in fields(Record)] == [getattr(called, f.name) for f in fields(Record)]
    assert SlotLayout(Twin, ["x", "y"]).new_instance(1, b"2") == Twin(1, b"2")


def test_the_core_names_every_slot_of_a_record() -> None:
    assert Message.__slots__ == ()  # a message's fields are the compiled Delivery's
    assert sorted(RECORD_FIELDS) == sorted(f.name for f in fields(Record))
    assert RECORD_LAYOUT.names == list(RECORD_FIELDS)


@dataclass(slots=True, eq=False)
class ShuffledRecord:
    """``Record``'s fields in another order: the core finds them by name."""

    quarantined: bool
    suspect: bool
    last_error: str | None
    attempts: int
    timestamp_ms: int
    size: int
    metadata: RecordMetadata
    headers: Any
    value: bytes | None
    key: bytes | None
    offset: int
    partition: int


def test_fields_in_another_order_are_read_and_written_by_name() -> None:
    """The slot contract is by name: a record class whose fields are declared in another order is
    made, queued, released and acked as ``Record`` is (the key it orders by, the attempts written
    on release, the suspect mark); a layout that names other slots, or the same in another order, is
    refused where the core reads by position."""
    shuffled = SlotLayout(ShuffledRecord, list(RECORD_FIELDS))
    values = dict(zip(RECORD_FIELDS, (0, 0, b"k", b"v", None, _META, 1, 5, 0, None, False, False), strict=True))
    made = [shuffled.new_instance(*{**values, "offset": offset, "key": key}.values())
            for offset, key in enumerate([b"k", b"j", b"k"])]
    assert [(r.partition, r.offset, r.key, r.timestamp_ms, r.quarantined) for r in made] == [
        (0, 0, b"k", 5, False), (0, 1, b"j", 5, False), (0, 2, b"k", 5, False)]
    core: PartitionCore[Any] = PartitionCore(ordered=True, attempts_before={0: 1}, suspects=True)
    core.add(made, 0, None, shuffled)
    deliveries = Deliveries(Message, shuffled, "orders", lambda message: None, True)
    messages, _ = core.release_messages(0.0, 10, 1, 10**6, None, pooled=True, leases=None, partition=0, epoch=1,
                                        deliveries=deliveries)
    assert [(m.record.offset, m.queue_key, m.attempt, m.record.attempts, m.record.suspect) for m in messages] == [
        (0, b"k", 2, 2, True), (1, b"j", 1, 1, False)]  # one per key in callback mode: 2 waits for 0
    assert partition_runs(made, shuffled) == [(0, 0, 3)]
    with pytest.raises(ValueError):
        Deliveries(Message, SlotLayout(ShuffledRecord, list(reversed(RECORD_FIELDS))), "t", print, True)
    with pytest.raises(TypeError):
        Deliveries(cast(Any, Record), RECORD_LAYOUT, "t", print, True)  # messages are Deliveries


def records(partition: int, keys: list[bytes | None]) -> list[Record]:
    return [Record(partition, offset, key, b"x" * offset, None, _META, offset, 0) for offset, key in enumerate(keys)]


def test_released_messages_are_those_the_message_class_makes() -> None:
    """What ``OwnedPartition.release_ready`` hands out: per message its record (its ``attempts`` set),
    the queue key (the key bytes, or the offset when unordered or without a key), the core's token,
    the attempt, the lease handle (0 without a lease table), the topic, the epoch, where acks go, not
    settled; out of the cyclic collector's sight."""
    acks: list[object] = []
    state = OwnedPartition(4, 7, ordered=True, topic="orders", submit=acks.append)
    state.add(records(4, [b"k", b"", None, b"j"]))
    messages, size = state.release_ready(0.0, 10, 1, 10**6, None, pooled=False)
    assert size == 0 + 1 + 2 + 3
    assert [type(m) for m in messages] == [Message] * 4
    assert [m.queue_key for m in messages] == [b"k", 1, 2, b"j"]
    fresh = [(m.attempt, m.record.attempts, m.delivery_attempt, m.lease, m.settled) for m in messages]
    assert fresh == [(1, 1, 1, 0, False)] * 4
    assert len({m.token for m in messages}) == 4 and all(m.token for m in messages)
    assert [(m.topic(), m.partition(), m.offset()) for m in messages] == [("orders", 4, o) for o in range(4)]
    assert not any(gc.is_tracked(m) or m.record.suspect for m in messages)
    messages[0].ack()
    assert acks == [messages[0]] and messages[0].settled
    assert state.core.ack_one(1, messages[1].token)  # the token is the core's
    unordered = OwnedPartition(0, 1, ordered=False)
    unordered.add(records(0, [b"k", b"k"]))
    assert [m.queue_key for m in unordered.release_ready(0.0, 10, 1, 10**6, None, pooled=True)[0]] == [0, 1]


def test_released_messages_carry_their_lease_handles_and_suspects() -> None:
    """With a lease table each message names its outstanding delivery there; a suspect (an attempt
    charged by an earlier owner, callback mode) is marked on its record, with the charged attempt
    counted."""
    leases = LeaseTable(ack_deadline=10.0, max_lease_duration=60.0, min_extension=10.0, max_extension=600.0)
    state = OwnedPartition(0, 2, ordered=True, attempts_before={0: 1}, suspects=True)
    state.add(records(0, [b"a", b"b"]))
    messages, _ = state.release_ready(0.0, 10, 1, 10**6, None, pooled=True, leases=leases)
    assert [(m.offset(), m.attempt, m.record.suspect) for m in messages] == [(0, 2, True), (1, 1, False)]
    assert leases.count == 2 and all(m.lease and leases.holds(m.lease) for m in messages)


def test_released_messages_and_records_are_freed_when_let_go() -> None:
    state = OwnedPartition(0, 1, ordered=True)
    state.add(records(0, [b"a"]))
    messages, _ = state.release_ready(0.0, 10, 1, 10**6, None, pooled=True)
    assert state.core.ack_one(0, messages[0].token)
    record = messages[0].record
    del messages
    assert sys.getrefcount(record) == 2  # this name and getrefcount's argument: the message and the core let go


@dataclass
class Fake:
    """A record of another class: read through its attributes."""

    partition: int
    offset: int
    key: bytes | None
    size: int


def test_fields_read_from_slots_are_those_read_as_attributes() -> None:
    """``partition_runs`` and ``PartitionCore.add`` read a ``Record``'s fields from its slots when
    given the layout, anything else's as attributes; ``LeaseTable.ack_run`` reads a ``Delivery``'s
    lease handle from its field, anything else's as an attribute."""
    batch: list[Any] = [*records(0, [b"a", b"b"]), *records(1, [b"a"]), Fake(1, 5, b"c", 2)]
    assert partition_runs(batch, RECORD_LAYOUT) == partition_runs(batch) == [(0, 0, 2), (1, 2, 4)]
    read = OwnedPartition(1, 1, ordered=True)
    plain: PartitionCore[Any] = PartitionCore(ordered=True)
    read.core.add(batch, 2, None, RECORD_LAYOUT)
    plain.add(batch, 2)
    assert read.core.ready_keys() == plain.ready_keys() == [b"a", b"c"]
    assert read.core.release_ready(0.0, 9, 1, 100)[3] == plain.release_ready(0.0, 9, 1, 100)[3] == 0 + 2
    leases = LeaseTable(ack_deadline=10.0, max_lease_duration=60.0, min_extension=10.0, max_extension=600.0)
    owned = {0: OwnedPartition(0, 1, ordered=True)}
    owned[0].add(records(0, [b"a", b"b", b"c"]))
    messages, _ = owned[0].release_ready(0.0, 10, 1, 10**6, None, pooled=True, leases=leases)
    assert leases.ack_run(messages[:1], owned, 0.0) == 1
    assert leases.ack_run([SimpleNamespace(lease=messages[1].lease)], owned, 0.0) == 1  # read as an attribute
    assert leases.ack_run(messages[:2], owned, 0.0) == 0 and leases.count == 1  # stale now


def test_the_collector_sees_what_layouts_and_deliveries_hold() -> None:
    """A subscriber's objects form cycles (the engine and its components): the collector must see
    through the core's objects to free them."""
    acks: list[object] = []
    deliveries = Deliveries(Message, RECORD_LAYOUT, "orders", acks.append, True)
    held = gc.get_referents(deliveries)
    assert Message in held and RECORD_LAYOUT in held and "orders" in held
    assert any(getattr(r, "__self__", None) is acks for r in held)
    assert Record in gc.get_referents(RECORD_LAYOUT)


def test_a_nack_stays_the_messages_last_word_for_its_run() -> None:
    """SUB-1 (a key's run, ``runs``): a message nacked (or given a deadline of 0) and then acked
    stays NACKED, so its run does not go on with the records the nack's rewind took back; a plain
    ack or ``ack_with_response`` alone leaves it True."""
    state = OwnedPartition(0, 1, ordered=True, submit=lambda request: None)
    state.add(records(0, [b"a", b"b", b"c", b"d"]))
    nacked, deadline_zero, acked, answered = state.release_ready(0.0, 10, 1, 10**6, None, pooled=True)[0]
    nacked.nack()
    nacked.ack()
    deadline_zero.modify_ack_deadline(0)
    deadline_zero.ack_with_response()
    acked.ack()
    answered.ack_with_response()
    assert [m.settled for m in (nacked, deadline_zero, acked, answered)] == [NACKED, NACKED, True, True]
