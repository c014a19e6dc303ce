"""Records and messages the core makes and reads (``core/src/record.rs``, ``core/src/delivery.rs``,
``PartitionCore.release_messages``): compiled records with the fields a ``Record`` is given, messages
made without running ``__init__``, both freed as they are."""

from __future__ import annotations

import gc
import sys
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

import pytest

from ordering_layer._core import Deliveries, LeaseTable, PartitionCore, partition_runs
from ordering_layer.record import RecordMetadata
from ordering_layer.subscriber.message import NACKED, Message
from ordering_layer.subscriber.owned_partition import OwnedPartition
from ordering_layer.subscriber.records import Record

_META = RecordMetadata(None, 1, None)


def test_a_record_has_the_fields_it_is_given() -> None:
    headers = [("h", b"1")]
    record = Record(3, 17, b"k", b"value", headers, _META, 5, 1_700_000_000_000)
    assert (record.partition, record.offset, record.key, record.value, record.headers, record.metadata,
            record.size, record.timestamp_ms) == (3, 17, b"k", b"value", headers, _META, 5, 1_700_000_000_000)
    assert record.headers is headers and record.metadata is _META  # shared, not copied
    assert (record.attempts, record.last_error, record.suspect, record.quarantined) == (0, None, False, False)
    named = Record(partition=0, offset=1, key=None, value=None, headers=None, metadata=_META, size=0, timestamp_ms=0,
                   attempts=2, last_error="boom", suspect=True, quarantined=True)
    assert (named.key, named.value, named.attempts, named.last_error, named.suspect, named.quarantined) == (
        None, None, 2, "boom", True, True)
    assert repr(record) == "Record(partition=3, offset=17, key=b'k', size=5, attempts=0)"
    with pytest.raises(TypeError):
        Record(0, 0, cast(Any, "k"), None, None, _META, 0, 0)  # a key is bytes (PUB-7) or None
    with pytest.raises(AttributeError):
        cast(Any, record).offset = 18  # what was fetched stays as fetched


def test_a_records_dispatch_fields_are_set_from_any_thread() -> None:
    """``attempts``, ``last_error``, ``suspect`` and ``quarantined`` change as the record is
    dispatched, read and set by the coordinator and the workers."""
    record = Record(0, 0, b"k", b"v", None, _META, 1, 0)
    record.attempts += 1
    record.last_error = "ValueError: bad"
    record.suspect = record.quarantined = True
    assert (record.attempts, record.last_error, record.suspect, record.quarantined) == (
        1, "ValueError: bad", True, True)
    record.last_error = None
    assert record.last_error is None

    def bump() -> None:
        for _ in range(2_000):
            record.attempts = record.attempts + 0  # reads and writes race without tearing
            record.last_error = "again"

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert (record.attempts, record.last_error) == (1, "again")


def test_a_record_is_freed_when_let_go() -> None:
    """(The native fetch's records are out of the collector's sight: ``test_native_fetch.py``.)"""
    value = b"payload-" + bytes(range(8))
    record = Record(0, 0, b"k", value, None, _META, len(value), 0)
    before = sys.getrefcount(value)
    del record
    assert sys.getrefcount(value) == before - 1  # the record let go of its value


def test_released_records_and_messages() -> None:
    """``Record``'s fields are what the core orders by, and the attempts and suspect mark written on
    release land on the record; ``partition_runs`` reads its partition; ``Deliveries`` makes
    ``Delivery`` subclasses only."""
    made = [Record(0, offset, key, b"v", None, _META, 1, 5) for offset, key in enumerate([b"k", b"j", b"k"])]
    core: PartitionCore[Any] = PartitionCore(ordered=True, attempts_before={0: 1}, suspects=True)
    core.add(made, 0, None)
    deliveries = Deliveries(Message, "orders", lambda message: None, True)
    messages, _ = core.release_messages(0.0, 10, 1, 10**6, None, pooled=True, leases=None, partition=0, epoch=1,
                                        deliveries=deliveries)
    assert [(m.record.offset, m.queue_key, m.attempt, m.record.attempts, m.record.suspect) for m in messages] == [
        (0, b"k", 2, 2, True), (1, b"j", 1, 1, False)]  # one per key in callback mode: 2 waits for 0
    assert messages[0].record is made[0] and messages[0].queue_key is made[0].key  # the key's bytes, shared
    assert partition_runs(made) == [(0, 0, 3)]
    with pytest.raises(TypeError):
        Deliveries(cast(Any, Record), "t", print, True)  # messages are Deliveries


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
    assert [m.suspect for m in messages] == [True, False], "the message reads its record's"
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
    metadata: RecordMetadata = _META
    timestamp_ms: int = 0


def test_fields_of_records_are_those_read_as_attributes() -> None:
    """``partition_runs`` and ``PartitionCore.add`` read a ``Record``'s fields directly, anything
    else's as attributes; ``LeaseTable.ack_run`` reads a ``Delivery``'s lease handle from its field,
    anything else's as an attribute."""
    batch: list[Any] = [*records(0, [b"a", b"b"]), *records(1, [b"a"]), Fake(1, 5, b"c", 2)]
    assert partition_runs(batch) == [(0, 0, 2), (1, 2, 4)]
    read = OwnedPartition(1, 1, ordered=True)
    plain: PartitionCore[Any] = PartitionCore(ordered=True)
    read.core.add(batch, 2, None)
    plain.add([SimpleNamespace(offset=r.offset, key=r.key, size=r.size, partition=r.partition) for r in batch], 2)
    assert read.core.ready_keys() == plain.ready_keys() == [b"a", b"c"]
    assert read.core.release_ready(0.0, 9, 1, 100)[3] == plain.release_ready(0.0, 9, 1, 100)[3] == 0 + 2
    leases = LeaseTable(ack_deadline=10.0, max_lease_duration=60.0, min_extension=10.0, max_extension=600.0)
    owned = {0: OwnedPartition(0, 1, ordered=True)}
    owned[0].add(records(0, [b"a", b"b", b"c"]))
    messages, _ = owned[0].release_ready(0.0, 10, 1, 10**6, None, pooled=True, leases=leases)
    assert leases.ack_run(messages[:1], owned, 0.0) == 1
    assert leases.ack_run([SimpleNamespace(lease=messages[1].lease)], owned, 0.0) == 1  # read as an attribute
    assert leases.ack_run(messages[:2], owned, 0.0) == 0 and leases.count == 1  # stale now


def test_the_collector_sees_what_deliveries_hold() -> None:
    """A subscriber's objects form cycles (the engine and its components): the collector must see
    through the core's objects to free them."""
    acks: list[object] = []
    deliveries = Deliveries(Message, "orders", acks.append, True)
    held = gc.get_referents(deliveries)
    assert Message in held and "orders" in held
    assert any(getattr(r, "__self__", None) is acks for r in held)


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
