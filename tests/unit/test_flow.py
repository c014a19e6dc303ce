"""The flow-control gate alone (SUB-7)."""

from __future__ import annotations

import threading

import pytest

from ordering_layer.config import FlowControl
from ordering_layer.record import RecordMetadata
from ordering_layer.subscriber.fetcher import payload_bytes
from ordering_layer.subscriber.flow import MAX_BUFFERED, MAX_BUFFERED_BYTES, MIN_READY, FlowGate, Gate
from ordering_layer.subscriber.records import Record


def test_gate_holds_over_a_limit_pauses_after_the_hold_and_opens_under_the_resume_fraction() -> None:
    """SUB-7: over max_messages the fetch is held, then paused; it resumes only under 80 % of the limits."""
    gate = FlowGate(FlowControl(max_messages=10, max_bytes=1000), hold_before_pause=1.0)
    gate.update(5, 50, 0, now=0.0)
    assert gate.fetch_state(0.0) is Gate.OPEN
    gate.update(10, 100, 0, now=1.0)
    assert gate.fetch_state(1.5) is Gate.HELD
    assert gate.fetch_state(2.0) is Gate.PAUSED
    gate.update(9, 90, 0, now=2.1)
    assert gate.state is Gate.PAUSED  # between the limits: no change
    gate.update(7, 70, 0, now=2.2)
    assert gate.fetch_state(2.2) is Gate.OPEN


def test_bytes_and_buffered_records_close_the_gate_too() -> None:
    """SUB-7: max_bytes bounds what is outstanding; buffered records bound memory."""
    gate = FlowGate(FlowControl(max_messages=10, max_bytes=1000), max_buffered=100)
    states = []
    for outstanding_bytes, buffered in ((1000, 0), (10, 0), (10, 100)):
        gate.update(1, outstanding_bytes, buffered, now=0.0)
        states.append(gate.state)
    assert states == [Gate.HELD, Gate.OPEN, Gate.HELD]
    assert gate.budget(4, 300) == (6, 700)


def test_the_fetch_waits_while_its_posted_records_wait_for_the_coordinator() -> None:
    """SUB-7: records posted by the fetch and not yet taken by the coordinator count against
    ``max_in_flight``, whatever the gate says: the fetch cannot run ahead of a long step."""
    gate = FlowGate(FlowControl(), max_in_flight=1000)
    assert gate.room_to_fetch() and gate.fetch_state(0.0) is Gate.OPEN
    gate.posted(500)
    assert gate.room_to_fetch()
    gate.posted(500)
    assert not gate.room_to_fetch() and gate.fetch_state(0.0) is Gate.OPEN
    gate.taken(500)
    assert gate.room_to_fetch() and gate.in_flight == 500


def _waits_in_thread(gate: FlowGate, timeout: float) -> threading.Thread:
    waiter = threading.Thread(target=gate.wait_for_room, args=(timeout,))
    waiter.start()
    return waiter


def test_a_held_fetch_is_woken_when_the_gate_opens_or_its_records_are_taken() -> None:
    """SUB-7: a fetch held over a limit sleeps on the gate, and the coordinator wakes it as it opens the
    gate (or takes the records that filled ``max_in_flight``), so that the releases do not run out of
    fetched records while it sleeps out a poll interval."""
    gate = FlowGate(FlowControl(max_messages=10, max_bytes=1000), max_in_flight=100)
    gate.update(10, 0, 0, now=0.0)
    waiter = _waits_in_thread(gate, 60.0)
    gate.update(7, 0, 0, now=0.1)
    waiter.join(10.0)
    assert not waiter.is_alive()
    gate.posted(100)
    waiter = _waits_in_thread(gate, 60.0)
    gate.taken(50)
    waiter.join(10.0)
    assert not waiter.is_alive()


def test_an_open_gate_does_not_make_the_fetch_wait() -> None:
    """SUB-7: with room to fetch, ``wait_for_room`` returns at once."""
    gate = FlowGate(FlowControl(), max_in_flight=100)
    waiter = _waits_in_thread(gate, 60.0)
    waiter.join(10.0)
    assert not waiter.is_alive()


def test_ample_ready_keys_hold_the_fetch_until_they_run_low() -> None:
    """SUB-7: with ``max_ready`` keys ready the fetch takes no records (``ample``), whatever the gate
    says; under ``resume_fraction`` of it the fetch is woken. The default is ``max_messages``, at least
    one fetch batch."""
    assert FlowGate(FlowControl(max_messages=4000)).max_ready == 4000
    assert FlowGate(FlowControl(max_messages=10)).max_ready == MIN_READY
    gate = FlowGate(FlowControl(max_messages=10, max_bytes=1000), max_ready=100)
    gate.update(0, 0, 200, now=0.0, ready=100)
    assert gate.ample and gate.fetch_state(0.0) is Gate.OPEN
    waiter = _waits_in_thread(gate, 60.0)
    gate.update(0, 0, 200, now=0.1, ready=80)
    assert gate.ample  # between the marks: no change
    gate.update(0, 0, 200, now=0.2, ready=79)
    waiter.join(10.0)
    assert not waiter.is_alive() and not gate.ample


def test_the_buffer_bound_is_by_count_for_small_records_and_by_bytes_for_large_ones() -> None:
    """Small records: ``max_buffered`` of them (40,000 by default, so that a backlog's batches of
    many partitions fit at once); large ones: ``max_buffered_bytes`` at the average size of the
    records fetched lately, which follows the batches posted."""
    gate = FlowGate(FlowControl(max_messages=1000, max_bytes=10**12))
    assert gate.buffer_limit() == MAX_BUFFERED == 40_000  # nothing fetched yet
    gate.posted(500, 500 * 100)  # 100-byte records
    assert gate.buffer_limit() == MAX_BUFFERED
    states = []
    gate.update(0, 0, MAX_BUFFERED - 1, 0.0)
    states.append(gate.state)
    for _ in range(40):
        gate.posted(10, 10 * 1_000_000)  # 1 MB records: 67 of them are 64 MiB
    assert abs(gate.record_bytes - 1_000_000) < 100
    assert gate.buffer_limit() == MAX_BUFFERED_BYTES // 1_000_000 == 67
    gate.update(0, 0, 67, 0.0)
    states.append(gate.state)
    gate.update(0, 0, 53, 1.0)  # under the resume fraction (0.8) of 67
    states.append(gate.state)
    assert states == [Gate.OPEN, Gate.HELD, Gate.OPEN]


def test_payload_bytes_estimates_a_batch_from_a_sample() -> None:
    records = [Record(0, n, b"k", b"x" * (100 + n), [], RecordMetadata(None, None, None), 10,
                      1_700_000_000_000) for n in range(1000)]
    assert payload_bytes(records) == pytest.approx(sum(100 + n for n in range(1000)), rel=0.05)
    assert payload_bytes(records[:1]) == 100
    assert payload_bytes([Record(0, 0, b"k", None, [], RecordMetadata(None, None, None), 10, 0)]) == 0


def test_partitions_short_of_records_take_their_share_while_the_buffer_holds_the_fetch() -> None:
    """SUB-2 across partitions: while the buffer limit holds the fetch, a partition under an eighth
    of its equal share of the limit may take up to the share, and stays short until it holds it;
    over the outstanding limits none does (SUB-7); with the gate open, none is short."""
    gate = FlowGate(FlowControl(max_messages=10, max_bytes=1000), max_buffered=800)
    woken: list[int] = []
    gate.on_room = lambda: woken.append(1)
    gate.update(0, 0, 100, now=0.0)
    gate.update_short({0: 100, 1: 0})
    assert gate.short == {}  # open
    gate.update(0, 0, 800, now=0.1)
    gate.update_short({0: 790, 1: 10})  # share 400: 1 is under 50
    assert gate.short == {1: 390} and woken
    gate.update_short({0: 700, 1: 100})  # over an eighth, under the share: still short
    assert gate.short == {1: 300}
    gate.update_short({0: 700, 1: 400})
    assert gate.short == {}
    gate.update_short({0: 700, 1: 100})  # not short again until under an eighth
    assert gate.short == {}
    gate.update(10, 0, 800, now=0.2)  # over max_messages: SUB-7 holds every partition
    gate.update_short({0: 790, 1: 0})
    assert gate.limited and gate.short == {}
    gate.update(9, 0, 800, now=0.3)  # not yet under 80 % of max_messages
    gate.update_short({0: 790, 1: 0})
    assert gate.short == {}
    gate.update(7, 0, 800, now=0.4)
    gate.update_short({0: 790, 1: 0})
    assert not gate.limited and gate.short == {1: 400}


def test_with_records_ample_only_a_partition_with_none_buffered_is_short() -> None:
    """While records are ample and the gate open, the others' records stay in librdkafka's
    prefetch: only a partition with none buffered is short."""
    gate = FlowGate(FlowControl(max_messages=10, max_bytes=1000), max_buffered=800, max_ready=100)
    gate.update(0, 0, 200, now=0.0, ready=100)
    assert gate.ample and gate.state is Gate.OPEN
    gate.update_short({0: 199, 1: 1, 2: 0})
    assert gate.short == {2: 266}
