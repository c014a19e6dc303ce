"""Partition ownership alone: generations route fetched records; partitions take turns at the budget."""

from __future__ import annotations

from typing import cast

from ordering_layer.config import SubscriptionSettings
from ordering_layer.record import RecordMetadata
from ordering_layer.state import StateStore
from ordering_layer.state.store import ClaimedPartition
from ordering_layer.subscriber.partitions import Partitions
from ordering_layer.subscriber.records import Record
from ordering_layer.subscriber.requests import Fetched


class FakeStore:
    def __init__(self) -> None:
        self.epoch = 0

    def claim(self, subscription: str, partition: int) -> ClaimedPartition:
        self.epoch += 1
        return ClaimedPartition(self.epoch, frozenset(), {})


def record(partition: int, offset: int) -> Record:
    return Record(partition, offset, b"k%d" % offset, b"x", [], RecordMetadata(None, 1, None), 1, 0)


def owning(partitions: int) -> Partitions:
    owned = Partitions(cast(StateStore, FakeStore()), "sub", SubscriptionSettings(topic="t"))
    for number in range(partitions):
        assert owned.claim(number, generation=1)
    return owned


def test_records_of_another_generation_are_dropped() -> None:
    """SUB-3: only records fetched under the generation a partition was claimed under reach it."""
    owned = owning(1)
    owned.take(Fetched([record(0, o) for o in range(3)], {0: 0}))
    owned.take(Fetched([record(0, o) for o in range(2, 5)], {0: 1}))
    assert owned.owned[0].watermark == 2 and owned.buffered() == 3


def test_partitions_share_a_small_budget_and_take_turns_at_it() -> None:
    """SUB-7: under flow control, freed budget is shared across partitions, starting one further each time."""
    owned = owning(3)
    owned.take(Fetched([record(p, o) for p in range(3) for o in range(10)], {0: 1, 1: 1, 2: 1}))
    first = owned.release(0.0, 3, 1, 10**9, None, pooled=True)
    assert sorted(state.partition for state, batch in first if batch) == [0, 1, 2]
    starts = [owned.release(0.0, 1, 1, 10**9, None, pooled=True)[0][0].partition for _ in range(3)]
    assert sorted(starts) == [0, 1, 2]
    offsets = owned.commit_offsets("t", sync=False)
    assert [(tp.partition, tp.offset) for tp in offsets] == [(0, 0), (1, 0), (2, 0)]
    assert owned.commit_offsets("t", sync=False) == []


def test_a_refused_commit_is_sent_again() -> None:
    """ACK-4: a commit point the coordinator refused (a rebalance, a loading coordinator) is queued
    again at the next interval, so an idle partition's committed offset does not stay behind."""
    owned = owning(2)
    owned.take(Fetched([record(0, 0), record(1, 0)], {0: 1, 1: 1}))
    assert [(tp.partition, tp.offset) for tp in owned.commit_offsets("t", sync=False)] == [(0, 0), (1, 0)]
    assert owned.commit_offsets("t", sync=False) == []
    owned.commit_failed(1)
    assert [(tp.partition, tp.offset) for tp in owned.commit_offsets("t", sync=False)] == [(1, 0)]
