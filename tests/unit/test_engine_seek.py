"""A running engine applying a seek (GRP-3), driven without Kafka or Redis threads."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping

import pytest
import redis

from ordering_layer.state.store import ClaimedPartition
from ordering_layer.subscriber.engine import Engine
from ordering_layer.subscriber.message import AckResponse, Message
from ordering_layer.subscriber.records import AWAITING_SEEK
from ordering_layer.subscriber.requests import Committed, SeekPartition, Sought
from tests.unit.test_engine import P0, FakeStore, make_engine, record, step


class SeekStore(FakeStore):
    """A fake store with a seek announced and pending for the partitions in ``pending``."""

    def __init__(self) -> None:
        super().__init__()
        self.announced = 0
        self.pending: dict[int, ClaimedPartition | None] = {}
        self.at_claim: ClaimedPartition | None = None
        self.applied: list[tuple[int, int, int]] = []
        self.marks_failing = 0

    def claim(self, subscription: str, partition: int) -> ClaimedPartition:
        if self.at_claim is not None:
            return self.at_claim
        return super().claim(subscription, partition)

    def seek_announced(self, subscription: str) -> int:
        return self.announced

    def claim_for_seek(self, subscription: str, epochs: Mapping[int, int]) -> dict[int, ClaimedPartition | None]:
        pending, self.pending = self.pending, {}
        return {p: c for p, c in pending.items() if p in epochs}

    def seek_applied(self, subscription: str, partition: int, epoch: int, generation: int) -> bool:
        if self.marks_failing:
            self.marks_failing -= 1
            raise redis.ConnectionError("Redis is down")
        self.applied.append((partition, epoch, generation))
        return True


@pytest.fixture
def store() -> SeekStore:
    return SeekStore()


@pytest.fixture
def handed() -> list[Message]:
    return []


@pytest.fixture
def engine(store: SeekStore, handed: list[Message]) -> Iterator[Engine]:
    engine = make_engine(store, handed.extend)
    yield engine
    engine.consumer.close()


def _queued_seeks(engine: Engine) -> list[SeekPartition]:
    requests = engine._fetcher._requests
    items = []
    while not requests.empty():
        items.append(requests.get_nowait())
    return [r for r in items if isinstance(r, SeekPartition)]


def _look_for_seeks(engine: Engine) -> None:
    engine._commits.last = 0.0  # the look comes with the next commit interval
    step(engine)


def test_a_running_engine_restarts_a_sought_partition_and_refuses_acks_of_before(
        engine: Engine, store: SeekStore, handed: list[Message]) -> None:
    """GRP-3, ACK-5, ACK-6, SUB-4: an announced seek restarts the owned partition at its target under a
    new epoch: deliveries of before are void (an ack of one after the seek is LEASE_LOST), records
    fetched before the consumer sought are dropped, the settled set of the seek is skipped (keys
    without an unsettled message before it stay quiet), attempts restart at 1, commits carry the
    seek generation, reports of commits of before trim nothing, and the first commit after the seek
    marks it applied."""
    engine._fetcher._on_assign(engine.consumer, P0)
    engine._handle([engine._fetcher.fetched([record(o) for o in range(6)])], time.monotonic())
    step(engine)
    assert [m.offset() for m in handed] == [0, 3, 1, 4, 2, 5]  # few keys ready: each key's run
    before = list(handed)
    handed.clear()
    store.announced = 1
    store.pending = {0: ClaimedPartition(10, frozenset({4}), {}, seek_generation=1, seek_offset=2)}

    _look_for_seeks(engine)

    state = engine._partitions[0]
    assert (state.epoch, state.generation, state.seek_generation) == (10, AWAITING_SEEK, 1)
    assert engine._leases.count == 0
    assert _queued_seeks(engine) == [SeekPartition(0, 2, 1)]
    answer = before[1].ack_with_response()
    step(engine)
    assert answer.result(1) is AckResponse.LEASE_LOST
    engine._handle([engine._fetcher.fetched([record(o) for o in range(2, 6)])], time.monotonic())
    assert state.buffered == 0  # fetched before the consumer sought: not this state's
    assert [tp.offset for tp in engine._commits.offsets(sync=True)] == [2]  # a purge would commit the target

    engine._fetcher.generations[0] += 1  # what the fetch thread does when the consumer has sought
    engine._handle([Sought(0, engine._fetcher.generations[0], 1)], time.monotonic())
    engine._handle([engine._fetcher.fetched([record(o) for o in range(2, 6)])], time.monotonic())
    step(engine)
    # 4 settled; 5 in 2's run (one worker starts it once 2 is acked).
    assert [(m.offset(), m.delivery_attempt) for m in handed] == [(2, 1), (5, 1), (3, 1)]
    [commit] = engine._commits.offsets(sync=True)
    assert (commit.offset, commit.metadata) == (2, "ol-seek:1")

    engine._handle([Committed([(0, 3, 0)])], time.monotonic())
    assert engine._partitions[0].take_ops() == "" and store.applied == []
    engine._handle([Committed([(0, 2, 1)])], time.monotonic())
    assert engine._partitions[0].take_ops() == ""
    assert store.applied == [(0, 10, 1)]
    # The floor of the state restarted by the seek is its target: what counts as acked after it.
    assert [op for _, op in store.op_log if op[0] == "f"] == [("f", 0, 0), ("f", 0, 2)]


def test_a_seek_pending_at_claim_starts_the_partition_at_its_target(engine: Engine, store: SeekStore) -> None:
    """GRP-3: a claim that applied a pending seek starts the consumer at the target (the fetcher
    assigns it there) and the commit point is the target until records arrive."""
    store.at_claim = ClaimedPartition(5, frozenset({9}), {}, seek_generation=3, seek_offset=7)
    assert engine._ownership.assigned([0], {0: 1}) == {0: 7}
    state = engine._partitions[0]
    assert (state.generation, state.seek_generation, state.watermark) == (1, 3, 7)
    engine._handle([Committed([(0, 7, 3)])], time.monotonic())
    assert store.applied == [(0, 5, 3)]


def test_a_fenced_owner_drops_the_partition_when_it_looks_for_seeks(engine: Engine, store: SeekStore) -> None:
    """ACK-5, GRP-3: an owner whose epoch is gone (another owner claimed the partition) lets it go."""
    engine._fetcher._on_assign(engine.consumer, P0)
    store.announced = 4
    store.pending = {0: None}
    _look_for_seeks(engine)
    assert 0 not in engine._partitions


def test_a_failed_applied_mark_is_retried_with_the_commit_sent_again(engine: Engine, store: SeekStore) -> None:
    """GRP-3: when Redis does not take the applied mark, the commit point is sent again at the next
    interval (an idle partition's commit would not move), and its report marks the seek applied."""
    store.at_claim = ClaimedPartition(5, frozenset(), {}, seek_generation=2, seek_offset=7)
    engine._ownership.assigned([0], {0: 1})
    assert [tp.offset for tp in engine._commits.offsets(sync=False)] == [7]
    store.marks_failing = 1
    engine._handle([Committed([(0, 7, 2)])], time.monotonic())
    assert store.applied == []
    [again] = engine._commits.offsets(sync=False)
    assert (again.offset, again.metadata) == (7, "ol-seek:2")
    engine._handle([Committed([(0, 7, 2)])], time.monotonic())
    assert store.applied == [(0, 5, 2)]
    assert engine._commits.offsets(sync=False) == []
