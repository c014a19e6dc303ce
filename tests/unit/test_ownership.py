"""Assignment, revocation, loss and fencing of one engine's partitions (``Ownership``), without Kafka."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, cast

from redis.exceptions import RedisError

from ordering_layer.config import SubscriptionSettings
from ordering_layer.state import ApplyResult, StateStore
from ordering_layer.state.pipe import Sent
from ordering_layer.state.store import ClaimedPartition, Op, OpKind, unpack_ops
from ordering_layer.subscriber.commits import Commits
from ordering_layer.subscriber.flushes import Flushes
from ordering_layer.subscriber.leases import lease_table
from ordering_layer.subscriber.message import AckResponse
from ordering_layer.subscriber.ownership import Ownership
from ordering_layer.subscriber.partitions import Partitions
from ordering_layer.subscriber.state_writer import StateWriter
from tests.model.test_partition import record
from tests.unit.test_engine_seek import SeekStore

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
        self.commits = Commits(self.owned, "t", "sub")
        self.flushes = Flushes("sub", self.owned, self.leases, self.writer, fenced=lambda p: self.ownership.fenced(p))
        self.ownership = Ownership("sub", SETTINGS, self.changed, self.owned, self.leases, self.writer, self.commits,
                                   self.flushes)

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
    assert rig.flushes.flush()
    assert sorted(rig.owned.owned) == [1] and rig.leases.count == 0
    assert rig.store.settings_stored == 1
    rig.store.failing = True
    rig.writer.push(rig.owned.owned[1], OpKind.SETTLED, 1, 0, 0.0)
    assert not rig.flushes.flush()


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


class DeliveringRig(Rig):
    """``Rig`` whose ``Flushes`` records the deliveries it hands back and calls ``wake`` when a flush
    in flight answers; partition 0 assigned."""

    def __init__(self, fake: VerdictStore | None, wake: Callable[[], Any]) -> None:
        super().__init__(fake)
        self.delivered: list[tuple[list[int], bool]] = []
        self.flushes = Flushes("sub", self.owned, self.leases, self.writer, fenced=lambda p: self.ownership.fenced(p),
                               deliver=lambda released, ok: self.delivered.append(
                                   ([m.record.offset for _, batch in released for m in batch], ok)),
                               wake=wake)
        self.ownership = Ownership("sub", SETTINGS, self.changed, self.owned, self.leases, self.writer, self.commits,
                                   self.flushes)
        self.ownership.assigned([0], {0: 1})

    def release(self, offsets: list[int]) -> None:
        """Fetched records of partition 0 released and held for the next flush."""
        state = self.owned.owned[0]
        state.add([record(o, b"k%d" % o) for o in offsets])
        batch, _ = state.release_ready(0.0, 100, 1, 10**9, None, pooled=True, leases=self.leases)
        self.flushes.hold([(state, batch)])


class AsyncRig(DeliveringRig):
    """A rig with a gated store and a wake-up event."""

    def __init__(self) -> None:
        self.gated = GatedStore()
        self.woken = threading.Event()
        super().__init__(self.gated, self.woken.set)

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
    rig.flushes.start(0.0)
    assert rig.gated.entered.wait(10) and rig.delivered == []  # Redis at work, the caller free
    rig.writer.push(rig.owned.owned[0], OpKind.SETTLED, 7, 0, 0.0)
    rig.release([2])
    rig.flushes.start(0.0)  # one in flight: nothing more is sent
    rig.flushes.poll()
    assert rig.delivered == [] and rig.flushes.next_due() is None
    rig.answer()
    rig.flushes.poll()
    assert rig.delivered == [([0, 1], True)]
    rig.flushes.start(0.0)
    rig.answer()
    rig.flushes.poll()
    assert rig.delivered == [([0, 1], True), ([2], True)]
    [first], [second] = rig.gated.written
    # The commit point (0) goes last as the partition's floor, once.
    assert [(op[0], op[1]) for op in first[1]] == [(OpKind.FIRST_RELEASED, 0), (OpKind.FIRST_RELEASED, 1),
                                                   (OpKind.FLOOR, 0)]
    assert [(op[0], op[1]) for op in second[1]] == [(OpKind.SETTLED, 7), (OpKind.FIRST_RELEASED, 2)]


def test_a_failed_flush_in_flight_gives_back_and_keeps_its_ops_ahead_of_later_ones() -> None:
    """DLQ-1, ACK-4: a flush that failed in flight gives its releases back (deliver False); its ops are
    sent again first, before the ops queued while it was in flight; its ack futures wait for them."""
    rig = AsyncRig()
    rig.release([0])
    future: Future[AckResponse] = Future()
    rig.writer.add_future(0, future)
    rig.gated.failing = True
    rig.flushes.start(0.0)
    assert rig.gated.entered.wait(10)
    rig.writer.push(rig.owned.owned[0], OpKind.SETTLED, 9, 0, 0.0)
    rig.answer()
    rig.flushes.poll()
    assert rig.delivered == [([0], False)] and not future.done()
    rig.gated.failing = False
    assert rig.writer.due(1.0)  # the failed ops make the next flush due
    rig.gated.gate.set()
    assert rig.flushes.flush()
    [[(_, ops)]] = rig.gated.written
    assert [(op[0], op[1]) for op in ops] == [(OpKind.FIRST_RELEASED, 0), (OpKind.FLOOR, 0), (OpKind.SETTLED, 9)]
    assert future.result(0) is AckResponse.SUCCESS


def test_a_verdict_in_flight_applies_only_to_the_ownership_that_sent_it() -> None:
    """ACK-5: a partition lost and claimed again while its flush was in flight: the old flush's fencing
    verdict does not drop the new ownership, and ops of the old one that failed are not sent for it."""
    rig = AsyncRig()
    rig.release([0])
    rig.gated.verdicts = {0: ApplyResult.FENCED}
    rig.flushes.start(0.0)
    assert rig.gated.entered.wait(10)
    rig.ownership.lost([0])
    rig.ownership.assigned([0], {0: 2})
    claimed = rig.owned.owned[0]
    rig.answer()
    rig.flushes.poll()
    assert rig.owned.owned.get(0) is claimed
    rig.gated.verdicts = {}
    rig.gated.failing = True
    rig.release([1])
    rig.flushes.start(0.0)
    assert rig.gated.entered.wait(10)
    rig.ownership.lost([0])
    rig.ownership.assigned([0], {0: 3})
    rig.answer()
    rig.flushes.poll()
    rig.gated.failing = False
    rig.gated.gate.set()
    assert rig.flushes.flush()
    assert len(rig.gated.written) == 1  # the first flush; nothing of the ownerships before was kept


class FakePipe:
    """Flushes written back to back to one connection: each answer waits for its gate, and the answers
    are read in the order written (the coordinator takes them one flush at a time once they came)."""

    def __init__(self) -> None:
        self.written: list[list[tuple[int, list[Op]]]] = []
        self.writers: list[str] = []  # the thread that wrote each flush
        self.ready = True  # a connection is open (else the write connects first)
        self._gates: dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self.failing: set[int] = set()  # flushes (by number) whose answer is an error
        self.reads = 0
        self.write_fails = False

    def gate(self, flush: int) -> threading.Event:
        """What the answer of the flush written ``flush``-th (from 0) waits for."""
        with self._lock:
            return self._gates.setdefault(flush, threading.Event())

    def send(self, batches: Sequence[tuple[str, int, int, str]]) -> Sent:
        if self.write_fails:
            raise RedisError("connection reset")
        self.writers.append(threading.current_thread().name)
        self.ready = True
        self.written.append([(partition, unpack_ops(packed)) for _, partition, _, packed in batches])
        return Sent(len(self.written) - 1, len(batches))

    def answered(self, sent: Sent) -> bool:
        return self.gate(sent.connection).is_set()

    @staticmethod
    def socket(sent: Sent) -> None:
        return None

    @staticmethod
    def timeout(sent: Sent) -> float:
        return 10.0

    def fail(self, sent: Sent) -> None:
        raise AssertionError(f"flush {sent.connection} timed out")

    def receive(self, sent: Sent) -> list[ApplyResult]:
        assert self.gate(sent.connection).wait(10)
        self.reads += 1
        if sent.connection in self.failing:
            raise RedisError("down")
        return [ApplyResult.APPLIED] * sent.count

    def close(self) -> None:
        pass


class PipelinedRig(DeliveringRig):
    """A rig with a pipelined writer (two flushes in flight at most) on a ``FakePipe``."""

    def __init__(self) -> None:
        self.woken = threading.Semaphore(0)
        super().__init__(None, self.woken.release)
        self.pipe = FakePipe()
        self.writer.pipe = cast(Any, self.pipe)
        self.writer.max_in_flight = 2

    def answer(self, flush: int) -> None:
        """Let a written flush's answer come, and apply what came (once the sending thread wrote it,
        when it did)."""
        self.pipe.gate(flush).set()
        deadline = time.monotonic() + 10.0
        while self.pipe.reads <= flush:
            assert time.monotonic() < deadline, f"flush {flush} not read"
            self.flushes.poll()
            if self.pipe.reads <= flush:
                self.woken.acquire(timeout=0.01)  # the sending thread's write is done


def test_a_pipelined_flush_goes_out_while_one_is_in_flight_and_answers_apply_in_order() -> None:
    """ACK-4, DLQ-3: with a pipelined writer, messages released while a flush is in flight go out in a
    second flush at once, written after the first on the same connection, so that a partition's ops
    reach Redis in the order queued; each flush's messages are handed out after its own answer, the
    answers applied in the order written; a third waits for a place."""
    rig = PipelinedRig()
    rig.release([0, 1])
    rig.flushes.start(0.0)
    rig.writer.push(rig.owned.owned[0], OpKind.SETTLED, 7, 0, 0.0)
    rig.flushes.start(0.0)  # ops queued, no message waiting: no second flush for them alone
    assert rig.flushes.in_flight == 1
    rig.release([2])
    rig.flushes.start(0.0)
    rig.release([3])
    rig.flushes.start(0.0)
    # Nothing is due but the oldest answer's timeout (10 s here); the answer itself wakes the coordinator.
    assert rig.flushes.in_flight == 2 and rig.flushes.next_due() > time.monotonic() + 5
    rig.answer(0)
    assert rig.delivered == [([0, 1], True)]
    rig.flushes.start(0.0)  # a place is free: the release waiting goes out
    rig.answer(1)
    rig.answer(2)
    assert rig.delivered == [([0, 1], True), ([2], True), ([3], True)]
    ops = [[(op[0], op[1]) for op in batch[0][1]] for batch in rig.pipe.written]
    assert ops == [[(OpKind.FIRST_RELEASED, 0), (OpKind.FIRST_RELEASED, 1), (OpKind.FLOOR, 0)],
                   [(OpKind.SETTLED, 7), (OpKind.FIRST_RELEASED, 2)], [(OpKind.FIRST_RELEASED, 3)]]


def test_a_failed_pipelined_flush_fails_the_one_written_after_it_and_their_ops_go_again_in_order() -> None:
    """ACK-4, DLQ-3: when the first of two flushes in flight fails, the second counts as failed too,
    whatever Redis answered it: both give their messages back, and their ops are written again in the
    order first queued, ahead of what was queued since; the flush after that takes them all."""
    rig = PipelinedRig()
    rig.release([0])
    rig.flushes.start(0.0)
    rig.release([1])
    rig.flushes.start(0.0)
    rig.pipe.failing = {0}
    rig.answer(0)
    rig.answer(1)
    assert rig.delivered == [([0], False), ([1], False)]
    rig.writer.push(rig.owned.owned[0], OpKind.SETTLED, 9, 0, 0.0)
    rig.flushes.start(1.0)
    rig.answer(2)
    [[(_, ops)]] = rig.pipe.written[2:]
    assert [(op[0], op[1]) for op in ops] == [(OpKind.FIRST_RELEASED, 0), (OpKind.FLOOR, 0), (OpKind.FIRST_RELEASED, 1),
                                              (OpKind.SETTLED, 9)]


def test_a_pipelined_flush_is_written_by_the_coordinator_once_a_connection_is_open() -> None:
    """ACK-4: a flush that needs a new connection (connect, script load) is written on the sending
    thread; once the connection is open the coordinator writes the next ones itself, after every
    earlier write, and reads each answer once it came."""
    rig = PipelinedRig()
    rig.pipe.ready = False
    rig.release([0])
    rig.flushes.start(0.0)
    rig.answer(0)
    rig.release([1])
    rig.flushes.start(0.0)
    rig.answer(1)
    assert rig.delivered == [([0], True), ([1], True)]
    assert rig.pipe.writers[0].startswith("ordering-layer-redis-sub")
    assert rig.pipe.writers[1] == threading.current_thread().name


def test_a_pipelined_flush_whose_write_failed_is_settled_at_the_next_step() -> None:
    """DLQ-3: a flush the coordinator failed to write has no answer to wait for: it is due at once,
    and the next poll gives its messages back."""
    rig = PipelinedRig()
    rig.pipe.write_fails = True
    rig.release([0])
    rig.flushes.start(0.0)
    assert rig.flushes.in_flight == 1
    due = rig.flushes.next_due()
    assert due is not None and due <= time.monotonic()
    rig.flushes.poll()
    assert rig.delivered == [([0], False)] and rig.flushes.in_flight == 0
