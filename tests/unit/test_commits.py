"""Commit interval, commit reports and seek look-ups of one engine (``Commits``), without Kafka or Redis."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import redis

from ordering_layer.config import SubscriptionSettings
from ordering_layer.state import ApplyResult, StateStore
from ordering_layer.state.store import ClaimedPartition, Op, OpKind
from ordering_layer.subscriber.commits import COMMIT_INTERVAL, Commits
from ordering_layer.subscriber.partitions import Partitions
from ordering_layer.subscriber.requests import Committed, SeekPartition
from ordering_layer.subscriber.state_writer import StateWriter
from tests.model.test_partition import record
from tests.unit.test_engine_seek import SeekStore


class OpsSeekStore(SeekStore):
    """A seek store that keeps the ops written, and can fail the seek look-up."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[int, Op]] = []
        self.lookup_failing = False

    def apply_many(self, batches: Sequence[tuple[str, int, int, Sequence[Op]]]) -> list[ApplyResult]:
        self.ops.extend((partition, op) for _, partition, _, ops in batches for op in ops)
        return super().apply_many(batches)

    def seek_announced(self, subscription: str) -> int:
        if self.lookup_failing:
            raise redis.ConnectionError("Redis is down")
        return super().seek_announced(subscription)


class Rig:
    """Partitions 0 and 1 owned (epochs 1 and 2), records 0..2 fetched in partition 0."""

    def __init__(self) -> None:
        self.store = OpsSeekStore()
        store = cast(StateStore, self.store)
        self.owned = Partitions(store, "sub", SubscriptionSettings(topic="t"))
        for number in (0, 1):
            assert self.owned.claim(number, 1)
        self.owned.owned[0].add([record(offset, b"k") for offset in range(3)])
        self.writer = StateWriter(store, "sub")
        self.commits = Commits(self.owned, "t", "sub")
        self.flushes = 0
        self.flush_ok = True

    def flush(self) -> bool:
        self.flushes += 1
        return self.flush_ok

    def written(self) -> list[tuple[int, Op]]:
        self.writer.flush(self.owned.owned)
        ops, self.store.ops = self.store.ops, []
        return ops


def test_commit_points_that_moved_are_taken_once_an_interval() -> None:
    """ACK-4: each interval commits the lowest unsettled offset of the partitions whose commit point moved,
    tagged with their seek generation; taking them starts the next interval."""
    rig = Rig()
    assert rig.commits.due(COMMIT_INTERVAL)
    assert [(tp.partition, tp.offset) for tp in rig.commits.offsets(sync=False)] == [(0, 0)]
    assert not rig.commits.due(rig.commits.last + COMMIT_INTERVAL / 2)
    assert rig.commits.due(rig.commits.last + COMMIT_INTERVAL)
    assert rig.commits.offsets(sync=False) == []
    state = rig.owned.owned[0]
    [delivery], _ = state.release_ready(0.0, 1, 1, 10**9, None, pooled=True)
    assert state.core.ack_one(0, delivery.token)
    [tp] = rig.commits.offsets(sync=False)
    assert (tp.offset, tp.metadata) == (1, "ol-seek:0")
    assert [tp.offset for tp in rig.commits.offsets(sync=True, only=[0])] == [1]  # a sync commit trusts nothing


def test_a_commit_report_writes_nothing_to_redis_and_a_refused_one_is_sent_again() -> None:
    """ACK-4: Redis forgets what is settled below the commit point with each flush (``FLOOR``), not
    when Kafka took the commit: a report queues no op; a refused commit is sent again."""
    rig = Rig()
    assert [tp.offset for tp in rig.commits.offsets(sync=False)] == [0]
    assert rig.written() == [(0, (OpKind.FLOOR, 0, 0))]  # the flush carries the commit point
    rig.commits.committed(Committed([(0, 1, 0), (1, 5, 0)]), 0.0)
    assert rig.written() == []
    assert rig.commits.offsets(sync=False) == []
    rig.commits.committed(Committed([], failed=(0,)), 0.0)
    assert [tp.offset for tp in rig.commits.offsets(sync=False)] == [0]


def test_a_seek_is_applied_once_after_writing_what_was_decided_before() -> None:
    """GRP-3: a newly announced seek flushes first, then restarts the partitions it is pending for (their
    consumer seeks are queued once) and makes the next step commit; the same announcement is not applied
    twice."""
    rig = Rig()
    rig.commits.offsets(sync=False)
    assert rig.commits.look_for_seek(rig.flush) == ([], []) and rig.flushes == 1  # the first look: none pending
    assert rig.commits.look_for_seek(rig.flush) == ([], []) and rig.flushes == 1  # nothing new announced
    rig.store.announced = 1
    rig.store.pending = {0: ClaimedPartition(7, frozenset(), {}, seek_generation=1, seek_offset=2), 1: None}
    assert rig.commits.look_for_seek(rig.flush) == ([0], [1])
    assert rig.flushes == 2 and rig.commits.last == 0.0  # the targets are committed at the next step
    assert rig.commits.take_seeks() == [SeekPartition(0, 2, 1)]
    assert rig.commits.take_seeks() == []
    assert rig.owned.owned[0].epoch == 7
    assert rig.commits.look_for_seek(rig.flush) == ([], []) and rig.flushes == 2


def test_a_look_for_seeks_that_cannot_flush_or_read_redis_is_made_again() -> None:
    """GRP-3: when the flush before a seek fails, or Redis cannot be read, nothing is applied and the
    announcement is looked at again at the next interval."""
    rig = Rig()
    rig.store.announced = 1
    rig.store.pending = {0: ClaimedPartition(7, frozenset(), {}, seek_generation=1, seek_offset=2)}
    rig.flush_ok = False
    assert rig.commits.look_for_seek(rig.flush) == ([], [])
    rig.flush_ok, rig.store.lookup_failing = True, True
    assert rig.commits.look_for_seek(rig.flush) == ([], [])
    assert rig.owned.owned[0].epoch == 1
    rig.store.lookup_failing = False
    assert rig.commits.look_for_seek(rig.flush) == ([0], [])
