"""Per-key hold queues and the backoff of their keys (``KeyQueue``, ``KeyBackoff``)."""

from __future__ import annotations

from ordering_layer.record import RecordMetadata
from ordering_layer.subscriber.records import QueueKey, Record
from tests.model.key_queue import KeyBackoff, KeyQueue, Quarantine


def test_a_key_queue_is_releasable_only_with_nothing_outstanding_after_its_backoff() -> None:
    """SUB-1, DLQ-1: a key releases when nothing of it is outstanding, its backoff has ended and a record
    waits beyond its cursor."""
    queue = KeyQueue()
    assert not queue.releasable(0.0)  # nothing fetched
    queue.records.append(Record(0, 0, b"k", b"x", None, RecordMetadata(None, 1, None), 1, 0))
    assert queue.releasable(0.0)
    queue.outstanding[0] = 7
    assert not queue.releasable(0.0)
    del queue.outstanding[0]
    queue.not_before = 5.0
    assert not queue.releasable(4.9) and queue.releasable(5.0)
    queue.cursor = 1  # delivered already
    assert not queue.releasable(5.0)


def test_backoff_ends_holds_in_due_time_order() -> None:
    """DLQ-1, SUB-2: each key waits out its own hold; ended keys come out in due-time order, once."""
    backoff = KeyBackoff()
    backoff.hold(b"a", 5.0)
    backoff.hold(b"b", 2.0)
    backoff.hold(7, 3.0)
    assert backoff.next_end() == 2.0
    assert backoff.ended(1.0) == []
    assert backoff.ended(3.0) == [b"b", 7]
    assert backoff.held == {b"a": 5.0}
    assert backoff.ended(10.0) == [b"a"]
    assert backoff.held == {} and backoff.ended(20.0) == []


def test_a_key_held_again_ends_at_its_last_hold_and_a_cancelled_key_never_ends() -> None:
    """DLQ-1: a later hold replaces an earlier one (its heap entry is stale); a cancelled hold ends nothing."""
    backoff = KeyBackoff()
    backoff.hold(b"a", 1.0)
    backoff.hold(b"a", 4.0)
    backoff.hold(b"b", 2.0)
    backoff.cancel(b"b")
    assert backoff.next_end() == 1.0  # the stale entry is still the heap's head
    assert backoff.ended(3.0) == []
    assert b"a" in backoff.held and b"b" not in backoff.held
    assert backoff.ended(4.0) == [b"a"]
    assert backoff.next_end() is None


def test_quarantine_admits_one_suspect_and_wakes_the_oldest_waiting_key() -> None:
    """DLQ-3: one suspect out at a time; keys refused wait in order and come back one per settle; a
    key admitted leaves the waiting keys."""
    quarantine = Quarantine()
    ready: dict[QueueKey, None] = {}
    assert quarantine.admit(b"a", 0)
    assert not quarantine.admit(b"b", 1) and not quarantine.admit(b"c", 2)
    assert quarantine.offset == 0 and list(quarantine.waiting) == [b"b", b"c"]
    quarantine.settled(ready)
    assert quarantine.offset is None and list(ready) == [b"b"] and list(quarantine.waiting) == [b"c"]
    assert quarantine.admit(b"c", 2)  # came back ready by another way (a new record of its key)
    assert not quarantine.waiting
    quarantine.settled(ready)
    assert list(ready) == [b"b"]
