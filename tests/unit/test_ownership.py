"""Assignment, revocation, loss and fencing of one engine's partitions (``Ownership``), without Kafka."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import cast

from ordering_layer.config import SubscriptionSettings
from ordering_layer.state import ApplyResult, StateStore
from ordering_layer.state.store import ClaimedPartition, Op, OpKind
from ordering_layer.subscriber.commits import Commits
from ordering_layer.subscriber.leases import lease_table
from ordering_layer.subscriber.message import AckResponse
from ordering_layer.subscriber.ownership import Ownership
from ordering_layer.subscriber.partitions import Partitions
from ordering_layer.subscriber.state_writer import StateWriter
from tests.unit.test_engine_seek import SeekStore
from tests.unit.test_partition import record

SETTINGS = SubscriptionSettings(topic="t")


class VerdictStore(SeekStore):
    """A seek store whose writes answer ``verdicts`` per partition (APPLIED otherwise)."""

    def __init__(self) -> None:
        super().__init__()
        self.verdicts: dict[int, ApplyResult] = {}
        self.settings_stored = 0

    def apply_many(self, batches: Sequence[tuple[str, int, int, Sequence[Op]]]) -> list[ApplyResult]:
        super().apply_many(batches)
        return [self.verdicts.get(partition, ApplyResult.APPLIED) for _, partition, _, _ in batches]

    def create_settings(self, subscription: str, settings: SubscriptionSettings) -> bool:
        self.settings_stored += 1
        return True


class Rig:
    def __init__(self, fake: VerdictStore | None = None) -> None:
        self.store = fake or VerdictStore()
        store = cast(StateStore, self.store)
        self.owned = Partitions(store, "sub", SETTINGS)
        self.leases = lease_table(SETTINGS)
        self.writer = StateWriter(store, "sub")
        self.changed = threading.Condition(threading.RLock())
        self.commits = Commits(self.owned, self.writer, "t", "sub")
        self.ownership = Ownership("sub", SETTINGS, self.changed, self.owned, self.leases, self.writer, self.commits)

    def deliver(self, partition: int, offset: int) -> None:
        """One record fetched and handed out in ``partition``."""
        state = self.owned.owned[partition]
        state.add([record(offset, b"k", partition)])
        state.release_ready(0.0, 10, 1, 10**9, None, pooled=True, leases=self.leases)


def test_an_assignment_claims_and_reports_where_a_seek_starts() -> None:
    """ACK-5, GRP-3: assigned partitions are claimed before their first fetch; a claim that applied a
    pending seek gives its target as the partition's start."""
    rig = Rig()
    assert rig.ownership.assigned([0, 1], {0: 1, 1: 1}) == {}
    assert sorted(rig.owned.owned) == [0, 1] and rig.owned.owned[1].generation == 1
    rig.store.at_claim = ClaimedPartition(9, frozenset(), {}, seek_generation=2, seek_offset=40)
    assert rig.ownership.assigned([2], {2: 3}) == {2: 40}


def test_a_revocation_waits_for_deliveries_in_progress_then_commits_and_lets_go() -> None:
    """SUB-5: a revoked partition stops releasing at once, but is let go only when its outstanding delivery
    is settled (or the ack deadline passes); then its commit point is returned for a sync commit."""
    rig = Rig()
    rig.ownership.assigned([0, 1], {0: 1, 1: 1})
    rig.deliver(0, 0)
    rig.deliver(1, 0)
    result: list[list[int]] = []
    revoker = threading.Thread(target=lambda: result.append([tp.offset for tp in rig.ownership.revoking([0])]))
    revoker.start()
    deadline = time.monotonic() + 10
    while not rig.owned.owned[0].revoking and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rig.owned.owned[0].revoking and revoker.is_alive()
    with rig.changed:
        handle = rig.leases.find(0, 0)
        assert handle is not None
        lease = rig.leases.lease_of(handle)
        assert lease is not None and rig.owned.owned[0].core.ack_one(0, lease[3])
        rig.leases.pop(handle)
        rig.changed.notify_all()
    revoker.join(SETTINGS.ack_deadline)
    assert result == [[1]]
    assert sorted(rig.owned.owned) == [1] and rig.leases.per_partition(0.0) == {1: (1, 0.0)}


def test_a_loss_lets_go_at_once_and_voids_queued_answers() -> None:
    """ACK-5: a lost partition is dropped with its outstanding deliveries; futures waiting on its queued
    ops learn LEASE_LOST."""
    rig = Rig()
    rig.ownership.assigned([0], {0: 1})
    rig.deliver(0, 0)
    future: Future[AckResponse] = Future()
    rig.writer.push(rig.owned.owned[0], OpKind.SETTLED, 0, 0, 0.0)
    rig.writer.add_future(0, future)
    rig.ownership.lost([0])
    assert rig.owned.owned == {} and rig.leases.count == 0
    assert future.result(0) is AckResponse.LEASE_LOST


def test_a_flush_drops_fenced_partitions_and_adopts_lost_state() -> None:
    """ACK-5: Redis's verdicts of a flush apply: a partition fenced by a newer owner is dropped, one whose
    state Redis lost is adopted again (the settings stored anew); a failed flush says so."""
    rig = Rig()
    rig.ownership.assigned([0, 1], {0: 1, 1: 1})
    rig.deliver(0, 0)
    rig.writer.push(rig.owned.owned[0], OpKind.SETTLED, 0, 0, 0.0)
    rig.writer.push(rig.owned.owned[1], OpKind.SETTLED, 0, 0, 0.0)
    rig.store.verdicts = {0: ApplyResult.FENCED, 1: ApplyResult.ADOPTED}
    assert rig.ownership.flush()
    assert sorted(rig.owned.owned) == [1] and rig.leases.count == 0
    assert rig.store.settings_stored == 1
    rig.store.failing = True
    rig.writer.push(rig.owned.owned[1], OpKind.SETTLED, 1, 0, 0.0)
    assert not rig.ownership.flush()


def test_a_seek_voids_the_deliveries_of_the_partitions_it_restarts() -> None:
    """GRP-3: partitions claimed again for a seek lose what they had outstanding; fenced ones are let go."""
    rig = Rig()
    rig.ownership.assigned([0, 1], {0: 1, 1: 1})
    rig.deliver(0, 0)
    rig.deliver(1, 0)
    rig.store.announced = 1
    rig.store.pending = {0: ClaimedPartition(9, frozenset(), {}, seek_generation=1, seek_offset=0), 1: None}
    rig.ownership.apply_seeks()
    assert list(rig.owned.owned) == [0] and rig.owned.owned[0].epoch == 9
    assert rig.leases.count == 0


class GatedStore(VerdictStore):
    """Writes wait for ``gate`` (Redis at work) and record what they carried, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.written: list[list[tuple[int, list[Op]]]] = []

    def apply_many(self, batches: Sequence[tuple[str, int, int, Sequence[Op]]]) -> list[ApplyResult]:
        self.entered.set()
        assert self.gate.wait(10)
        self.gate.clear()
        answers = super().apply_many(batches)
        self.written.append([(partition, list(ops)) for _, partition, _, ops in batches])
        return answers


class AsyncRig(Rig):
    """``Rig`` with a gated store, a wake-up event and the deliveries ``Ownership`` hands back."""

    def __init__(self) -> None:
        self.gated = GatedStore()
        super().__init__(self.gated)
        self.delivered: list[tuple[list[int], bool]] = []
        self.woken = threading.Event()
        self.ownership = Ownership("sub", SETTINGS, self.changed, self.owned, self.leases, self.writer, self.commits,
                                   deliver=lambda released, ok: self.delivered.append(
                                       ([m.record.offset for _, batch in released for m in batch], ok)),
                                   wake=self.woken.set)
        self.ownership.assigned([0], {0: 1})

    def release(self, offsets: list[int]) -> None:
        """Fetched records of partition 0 released and held for the next flush."""
        state = self.owned.owned[0]
        state.add([record(o, b"k%d" % o) for o in offsets])
        batch, _ = state.release_ready(0.0, 100, 1, 10**9, None, pooled=True, leases=self.leases)
        self.ownership.hold([(state, batch)])

    def answer(self) -> None:
        """Let the write in flight through and wait for its wake-up."""
        self.gated.gate.set()
        assert self.woken.wait(10)
        self.woken.clear()


def test_a_flush_is_sent_on_its_own_thread_one_at_a_time_and_delivers_after_its_answer() -> None:
    """DLQ-3, ACK-4: released messages reach user code only after the flush that took their attempts;
    while a flush is in flight the coordinator goes on (the call returns at once) and what it queues
    meanwhile waits for the next flush, so a partition's ops reach Redis in the order queued."""
    rig = AsyncRig()
    rig.release([0, 1])
    rig.ownership.start(0.0)
    assert rig.gated.entered.wait(10) and rig.delivered == []  # Redis at work, the caller free
    rig.writer.push(rig.owned.owned[0], OpKind.SETTLED, 7, 0, 0.0)
    rig.release([2])
    rig.ownership.start(0.0)  # one in flight: nothing more is sent
    rig.ownership.poll()
    assert rig.delivered == [] and rig.ownership.next_due() is None
    rig.answer()
    rig.ownership.poll()
    assert rig.delivered == [([0, 1], True)]
    rig.ownership.start(0.0)
    rig.answer()
    rig.ownership.poll()
    assert rig.delivered == [([0, 1], True), ([2], True)]
    [first], [second] = rig.gated.written
    assert [(op[0], op[1]) for op in first[1]] == [(OpKind.RELEASED, 0), (OpKind.RELEASED, 1)]
    assert [(op[0], op[1]) for op in second[1]] == [(OpKind.SETTLED, 7), (OpKind.RELEASED, 2)]


def test_a_failed_flush_in_flight_gives_back_and_keeps_its_ops_ahead_of_later_ones() -> None:
    """DLQ-1, ACK-4: a flush that failed in flight gives its releases back (deliver False); its ops are
    sent again first, before the ops queued while it was in flight; its ack futures wait for them."""
    rig = AsyncRig()
    rig.release([0])
    future: Future[AckResponse] = Future()
    rig.writer.add_future(0, future)
    rig.gated.failing = True
    rig.ownership.start(0.0)
    assert rig.gated.entered.wait(10)
    rig.writer.push(rig.owned.owned[0], OpKind.SETTLED, 9, 0, 0.0)
    rig.answer()
    rig.ownership.poll()
    assert rig.delivered == [([0], False)] and not future.done()
    rig.gated.failing = False
    assert rig.writer.due(1.0)  # the failed ops make the next flush due
    rig.gated.gate.set()
    assert rig.ownership.flush()
    [[(_, ops)]] = rig.gated.written
    assert [(op[0], op[1]) for op in ops] == [(OpKind.RELEASED, 0), (OpKind.SETTLED, 9)]
    assert future.result(0) is AckResponse.SUCCESS


def test_a_verdict_in_flight_applies_only_to_the_ownership_that_sent_it() -> None:
    """ACK-5: a partition lost and claimed again while its flush was in flight: the old flush's fencing
    verdict does not drop the new ownership, and ops of the old one that failed are not sent for it."""
    rig = AsyncRig()
    rig.release([0])
    rig.gated.verdicts = {0: ApplyResult.FENCED}
    rig.ownership.start(0.0)
    assert rig.gated.entered.wait(10)
    rig.ownership.lost([0])
    rig.ownership.assigned([0], {0: 2})
    claimed = rig.owned.owned[0]
    rig.answer()
    rig.ownership.poll()
    assert rig.owned.owned.get(0) is claimed
    rig.gated.verdicts = {}
    rig.gated.failing = True
    rig.release([1])
    rig.ownership.start(0.0)
    assert rig.gated.entered.wait(10)
    rig.ownership.lost([0])
    rig.ownership.assigned([0], {0: 3})
    rig.answer()
    rig.ownership.poll()
    rig.gated.failing = False
    rig.gated.gate.set()
    assert rig.ownership.flush()
    assert len(rig.gated.written) == 1  # the first flush; nothing of the ownerships before was kept
