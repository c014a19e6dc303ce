"""The compiled dispatch core (``ordering_layer._core``) against ``PartitionState``, its reference.

Both are driven with the same random operation sequences (hypothesis) after the same claim (a
recovery walk's settled offsets, attempts charged to records an earlier owner handed out, in
callback mode as suspects or in pull mode not): fetched batches (gaps, duplicates, empty and absent
keys), releases under message, byte and per-key budgets into a callback pool or to a pull, with and
without a batch lease, acks in batches, nacks and lapses with and without backoff, requeues (with
the attempt taken back, as the engine's give-back does), dead-letter settlements, stale tokens and
wakes. After every operation the two must agree on what went out (offset, queue key, attempt,
suspect or not), on every verdict, and on the commit point, the ready keys in order, the buffered
count, the held keys, the next wake, the outstanding quarantined suspect and the keys waiting for it
in order (``key_queue.Quarantine``, DLQ-3). The Redis ops the core packs are checked against the engine's
(``Dispatcher._admit``, ``Settlement``).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ordering_layer._core import PartitionCore, partition_runs
from ordering_layer.record import RecordMetadata
from ordering_layer.subscriber.owned_partition import OwnedPartition
from ordering_layer.subscriber.records import QueueKey, Record
from tests.model.partition import PartitionState

_KEYS = [None, b"", b"a", b"b", b"c", b"d", b"\x00k"]
_META = RecordMetadata(None, 1, None)


def record(offset: int, key: bytes | None, size: int, partition: int = 0) -> Record:
    return Record(partition, offset, key, b"v" * size, None, _META, size, 0)


# A delivery made: offset, the Python token, the core's token, queue key, key bytes, attempt.
Delivered = tuple[int, int, int, QueueKey, bytes | None, int]


@dataclass
class Twin:
    """A ``PartitionState`` and a ``PartitionCore`` fed the same operations; their deliveries."""

    py: PartitionState
    core: PartitionCore[Record]
    ordered: bool
    now: float = 0.0
    next_offset: int = 0
    deliveries: list[Delivered] = field(default_factory=list)
    latest: dict[int, Delivered] = field(default_factory=dict)  # the last delivery of each offset
    ops: list[str] = field(default_factory=list)
    settled_aside: set[int] = field(default_factory=set)  # dead-lettered while not outstanding
    # Offsets whose next attempt is not their first (charged by the claim, settled before it, or
    # released since): their attempts go to the attempts hash, not to a first-attempt run.
    written: set[int] = field(default_factory=set)
    in_hash: set[int] = field(default_factory=set)  # offsets the attempts hash may have a field of

    def __post_init__(self) -> None:
        charged = set(self.py._attempts_before)
        self.written |= charged
        self.in_hash |= charged

    def check(self) -> None:
        py, core = self.py, self.core
        assert core.watermark == py.watermark
        assert core.next_offset == py.tracker.next_offset
        assert core.buffered == py.buffered
        assert core.ready_keys() == list(py.ready)
        assert core.next_wake() == py.next_wake()
        assert core.held_keys() == py.held_keys()
        assert core.walking == py.walking
        assert core.quarantined == py.quarantine.offset
        assert core.waiting_keys() == list(py.quarantine.waiting)
        out = [r.offset for q in py.keys.values() for r in q.records if r.quarantined and r.offset in q.outstanding]
        assert out == ([] if py.quarantine.offset is None else [py.quarantine.offset])  # one out at most
        assert core.take_ops() == "".join(self.ops)
        self.ops.clear()
        # Nothing below the commit point goes out again (what the floor written with it relies on):
        # every record still queued and not settled is at or above it (a record dead-lettered while
        # not outstanding aside: it is settled, whatever happens to it next).
        if py.watermark is not None:
            assert all(r.offset >= py.watermark for q in py.keys.values() for r in q.records
                       if r.offset not in q.acked and r.offset not in self.settled_aside)

    def add(self, specs: list[tuple[int, int, int]]) -> None:
        """Fetched records: (gap before the offset, key index, size); a gap of -1 repeats an offset."""
        records = []
        for gap, key, size in specs:
            offset = max(0, self.next_offset - 3) if gap < 0 else self.next_offset + gap
            self.next_offset = max(self.next_offset, offset + 1)
            records.append(record(offset, _KEYS[key], size))
        taken = [self.py.add(r) for r in records]
        self.take_cascade_ops()
        skipped = self.core.add(records)
        assert skipped == [r.offset for r, took in zip(records, taken, strict=True) if not took]

    def take_cascade_ops(self) -> None:
        """The reference's cascade ops: the core's UNSETTLED, CASCADE_FROM and CASCADE_DONE ops."""
        self.ops.extend(f"{kind},{offset},0;" for kind, offset in self.py.cascade_ops)
        for kind, offset in self.py.cascade_ops:
            if kind == "u":  # settled, and goes out again: not its first attempt
                self.written.add(offset)
                self.in_hash.add(offset)
        self.py.cascade_ops.clear()

    def release(self, budget: int, per_key: int, byte_budget: int, lease: bool, pooled: bool) -> None:
        """A release into the callback pool (``pooled``) or to a pull, queued as ``Dispatcher._admit``
        queues it."""
        lease_ms = 99 if lease else None
        expected = self.py.release_ready(self.now, budget, per_key, byte_budget)
        items, tokens, attempts, size, suspects, _ = self.core.release_ready(
            self.now, budget, per_key, byte_budget, lease_ms, pooled=pooled)
        assert [r.offset for r in items] == [d.record.offset for d in expected]
        assert all(item is d.record for item, d in zip(items, expected, strict=True))
        assert attempts == [d.attempt for d in expected]
        assert size == sum(d.record.size for d in expected)
        assert suspects == [i for i, d in enumerate(expected) if d.record.suspect]
        for delivery, token in zip(expected, tokens, strict=True):
            r = delivery.record
            self.deliveries.append((r.offset, delivery.token, token, delivery.queue_key, r.key, delivery.attempt))
            self.latest[r.offset] = self.deliveries[-1]
        if expected:
            self.ops.append("b,0,99;" if lease else "")
            letter = {(False, False): "d", (False, True): "r", (True, False): "e", (True, True): "q"}[lease, pooled]
            for d in expected:
                offset = d.record.offset
                if offset in self.written:
                    self.in_hash.add(offset)
                    self.ops.append(f"{letter},{offset},{d.attempt};")
                else:
                    self.ops.append(f"{letter.upper()},{offset},{d.attempt};")
                self.written.add(offset)

    def ack(self, picks: list[tuple[bool, int]]) -> None:
        chosen = [self.pick(i) for i in picks]
        verdicts = []
        for offset, py_token, _, qkey, _, _ in chosen:
            verdicts.append(self.py.ack(qkey, offset, py_token))
            if verdicts[-1]:
                self.ops.append(f"a,{offset},{0 if offset in self.in_hash else 2};")
        refused, watermark = self.core.ack([d[0] for d in chosen], [d[2] for d in chosen])
        assert refused == [i for i, accepted in enumerate(verdicts) if not accepted]
        assert watermark == self.py.watermark

    def pick(self, choice: tuple[bool, int]) -> Delivered:
        """A delivery outstanding now, or (``stale``) any delivery made so far."""
        stale, index = choice
        outstanding = self.outstanding()
        if stale or not outstanding:
            return self.deliveries[-1 - index % len(self.deliveries)]
        return self.latest[outstanding[index % len(outstanding)]]

    def outstanding(self) -> list[int]:
        return sorted(offset for queue in self.py.keys.values() for offset in queue.outstanding)

    def out(self, offset: int) -> tuple[bool, int]:
        """The pick of the outstanding delivery of ``offset``."""
        return False, self.outstanding().index(offset)

    def nack(self, pick: tuple[bool, int], step: float, lapsed: bool) -> None:
        """A nack from user code, or a lapsed lease, with ``Settlement``'s op for each."""
        offset, py_token, core_token, qkey, _, attempt = self.pick(pick)

        def backoff(failures: int) -> float:
            return step * failures

        accepted = self.py.nack(qkey, offset, py_token, self.now, backoff)
        assert self.core.nack(offset, core_token, self.now, backoff, lapsed=lapsed) == accepted
        self.take_cascade_ops()
        if accepted:
            self.ops.append(f"n,{offset},{0 if lapsed else attempt};")
            if not lapsed:
                self.in_hash.add(offset)

    def requeue(self, pick: tuple[bool, int], delay: float, uncount: bool) -> None:
        offset, py_token, core_token, qkey, _, _ = self.pick(pick)
        if uncount:  # the engine's unrelease: only deliveries of the step, the token current
            queue = self.py.keys.get(qkey)
            if queue is None or queue.outstanding.get(offset) != py_token:
                return
            next(r for r in queue.records if r.offset == offset).attempts -= 1
        accepted = self.py.requeue(qkey, offset, py_token, self.now, delay)
        assert self.core.requeue(offset, core_token, self.now, delay, uncount=uncount) == accepted
        self.take_cascade_ops()

    def dead_lettered(self, pick: tuple[bool, int]) -> None:
        offset, _, _, qkey, key, _ = self.pick(pick)
        if offset not in self.outstanding():
            self.settled_aside.add(offset)
        self.py.settle_dead_lettered(qkey, offset)
        self.core.settle_dead_lettered(offset, key)
        self.ops.append(f"a,{offset},0;")

    def end_walk(self) -> None:
        self.py.end_walk()
        self.core.end_walk()
        self.take_cascade_ops()

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.py.wake(self.now)
        self.core.wake(self.now)


_batch = st.lists(st.tuples(st.sampled_from([-1, 0, 0, 0, 1, 3]), st.integers(0, len(_KEYS) - 1),
                            st.integers(0, 4)), min_size=1, max_size=12)
_recent = st.tuples(st.sampled_from([False, False, False, False, True]), st.integers(0, 12))
_operation = st.one_of(
    st.tuples(st.just("add"), _batch),
    st.tuples(st.just("release"), st.integers(1, 8), st.sampled_from([1, 1, 2, 3, 5]), st.integers(1, 12),
              st.booleans(), st.booleans()),
    st.tuples(st.just("ack"), st.lists(_recent, min_size=1, max_size=6)),
    st.tuples(st.just("nack"), _recent, st.sampled_from([0.0, 0.5, 1.0]), st.booleans()),
    st.tuples(st.just("requeue"), _recent, st.sampled_from([0.0, 1.0]), st.booleans()),
    st.tuples(st.just("dead_lettered"), _recent),
    st.tuples(st.just("advance"), st.sampled_from([0.0, 0.25, 0.5, 1.0, 3.0])),
    st.tuples(st.just("end_walk")),
)


_ON_DELIVERIES = {"ack", "nack", "requeue", "dead_lettered"}


# A claim: offsets settled above the commit point, attempts charged to unsettled ones (0 included:
# ``charged_attempts`` caps an unstarted attempt at max_attempts - 1).
_settled_before = st.frozensets(st.integers(0, 15), max_size=8)
_cascades = st.frozensets(st.integers(0, 15), max_size=3)  # marks of an owner whose walk ended early
_attempts_before = st.dictionaries(st.integers(0, 24), st.integers(0, 4), max_size=16)
_floor = st.one_of(st.none(), st.integers(0, 12))  # the commit point an earlier owner wrote to Redis


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ordered=st.booleans(), settled=_settled_before, charged=_attempts_before, suspects=st.booleans(),
       cascades=_cascades, floor=_floor, operations=st.lists(_operation, min_size=20, max_size=80))
def test_core_decides_as_partition_state(ordered: bool, settled: frozenset[int], charged: dict[int, int],
                                         suspects: bool, cascades: frozenset[int], floor: int | None,
                                         operations: list[tuple[object, ...]]) -> None:
    """SUB-1, SUB-2, SUB-3, SUB-4, SUB-6, SUB-7, ACK-4, ACK-6, DLQ-1, DLQ-3: for any claim (a floor
    included) and any
    sequence of fetches, releases, acks, nacks, lapses, requeues, dead-letter settlements, wakes and
    walks ended early (with the marks of an earlier owner's),
    the compiled core releases the same records in the same order with the same attempts and suspect
    flags, gives the same verdicts and keeps the same commit point, ready keys, buffered count,
    backoffs and quarantine (the outstanding quarantined suspect, the keys waiting for it in order)
    as ``PartitionState``, and packs the engine's Redis ops."""
    twin = Twin(PartitionState(0, 1, ordered=ordered, settled_before=settled, attempts_before=charged,
                               suspects=suspects, cascades=cascades, floor=floor),
                PartitionCore(ordered=ordered, settled_before=settled, attempts_before=charged, suspects=suspects,
                              cascades=cascades, floor=floor),
                ordered)
    twin.check()
    for name, *args in operations:
        if name in _ON_DELIVERIES and not twin.deliveries:
            continue
        getattr(twin, str(name))(*args)
        twin.check()


def test_a_key_dead_lettered_while_it_waits_for_the_quarantine_waits_no_more() -> None:
    """DLQ-3 (an example hypothesis found): unordered, two suspects charged two attempts each (4 and
    6, both quarantined). 4 goes out alone, is nacked, and waits while 6 is out; then 4's dead letter
    is written (its earlier delivery's), so it leaves its queue, which empties: the key waits for
    nothing any more, and when 6 is settled no key is made ready in its place."""
    twin = Twin(PartitionState(0, 1, ordered=False, settled_before=frozenset({0, 5, 7}), attempts_before={4: 2, 6: 2},
                               suspects=True),
                PartitionCore(ordered=False, settled_before={0, 5, 7}, attempts_before={4: 2, 6: 2}, suspects=True),
                False)
    steps: list[tuple[Any, ...]] = [
        *[("add", [(-1, 0, 0)])] * 9, ("add", [(3, 0, 0), *[(0, 0, 0)] * 5]), ("ack", [(False, 0)]),
        ("add", [(0, 0, 0)]), ("release", 1, 1, 1, False, False), ("nack", (False, 0), 0.0, False), ("end_walk",),
        ("add", [(-1, 0, 0)]), ("add", [(-1, 0, 0)]), ("release", 1, 1, 1, False, False),
        ("release", 4, 1, 1, False, False)]
    for name, *args in steps:
        if name in _ON_DELIVERIES and not twin.deliveries:
            continue
        getattr(twin, name)(*args)
        twin.check()
    assert (twin.core.quarantined, twin.core.waiting_keys()) == (6, [4])
    twin.dead_lettered((True, 4))  # the first delivery, of offset 4: not outstanding, waiting to go again
    twin.check()
    assert (twin.core.quarantined, twin.core.waiting_keys()) == (6, [])
    twin.ack([twin.out(6)])
    twin.check()
    assert (twin.core.quarantined, twin.core.ready_keys()) == (None, [])


def test_stale_tokens_of_another_partition_state_are_refused() -> None:
    """ACK-5: tokens are unique in the process, so a delivery of an earlier ownership of the same
    partition (a new core after a re-claim) never matches a delivery of the new one."""
    records = [record(0, b"k", 1)]
    old: PartitionCore[Record] = PartitionCore(ordered=True)
    old.add(records)
    _, (old_token,), _, _, _, _ = old.release_ready(0.0, 1, 1, 10)
    new: PartitionCore[Record] = PartitionCore(ordered=True)
    new.add(records)
    _, (new_token,), _, _, _, _ = new.release_ready(0.0, 1, 1, 10)
    assert new.ack([0], [old_token]) == ([0], 0)
    assert new.ack([0], [new_token]) == ([], 1)


def test_partition_runs_split_a_fetched_batch() -> None:
    """The runs of one partition in a fetched batch, in order (a partition may come back later)."""
    partitions = [3, 3, 1, 1, 1, 3, 0]
    records = [record(offset, b"k", 1, partition) for offset, partition in enumerate(partitions)]
    assert partition_runs(records) == [(3, 0, 2), (1, 2, 5), (3, 5, 6), (0, 6, 7)]
    assert partition_runs([]) == []
    core: PartitionCore[Record] = PartitionCore(ordered=True)
    assert core.add(records, 2, 5) == []
    assert (core.next_offset, core.buffered) == (5, 3)


def test_handed_out_messages_are_out_of_the_cyclic_collectors_sight() -> None:
    """Messages are freed by reference counting (as natively fetched records are): thousands are
    outstanding at a time, and young collections walking them cost a tenth of the subscriber's time."""
    state = OwnedPartition(0, 1, ordered=True)
    state.add([record(offset, b"k%d" % offset, 1) for offset in range(3)])
    messages, _ = state.release_ready(0.0, 10, 1, 100, None, pooled=True)
    assert len(messages) == 3 and not any(gc.is_tracked(m) for m in messages)


def test_op_buffer_keeps_decision_order() -> None:
    """ACK-4: ops queued from Python (a lease extension) and by the core (a settle) reach Redis in
    the order decided, as ``apply.lua`` applies them in sequence."""
    core: PartitionCore[Record] = PartitionCore(ordered=False)
    core.add([record(offset, None, 1) for offset in range(2)])
    _, tokens, _, _, _, _ = core.release_ready(0.0, 2, 1, 10, lease_ms=7)
    core.push_op("l", 0, 11)
    core.ack([0, 1], tokens)
    assert core.ops_count == 6
    assert core.take_ops() == "b,0,7;E,0,1;E,1,1;l,0,11;a,0,2;a,1,2;"
    assert (core.take_ops(), core.ops_count) == ("", 0)


def test_a_cascade_unsettles_in_redis_what_it_delivers_again() -> None:
    """SUB-4 across a crash: a settled record that goes out again in a cascade is dropped from the
    settled set (``UNSETTLED``) before its release, so that an owner that dies mid-cascade leaves the
    rest of it to the next owner's recovery walk. Both the rewind of a nack over acked records and
    the walk over records settled before a crash, for a key that cascades, queue it."""
    core: PartitionCore[Record] = PartitionCore(ordered=True)
    core.add([record(offset, b"k", 1) for offset in range(3)])
    batch, tokens, _, _, _, _ = core.release_ready(0.0, 3, 3, 10)  # a pull's batch of the key
    assert [r.offset for r in batch] == [0, 1, 2]
    core.ack([1, 2], tokens[1:])
    core.take_ops()
    assert core.nack(0, tokens[0], 0.0, lambda failures: 0.0, lapsed=False)
    assert core.take_ops() == "u,1,0;u,2,0;n,0,1;"
    # What the cascade unsettled holds the commit point (and the floor written with it) again: the
    # ack of the record the key rewound to does not carry it past them.
    again, again_tokens, _, _, _, _ = core.release_ready(0.0, 1, 1, 10)
    core.ack([0], again_tokens)
    assert [r.offset for r in again] == [0] and core.watermark == 1
    assert core.take_ops(floor=True) == "d,0,2;a,0,0;f,0,1;"
    reference = PartitionState(0, 1, ordered=True)
    for offset in range(3):
        reference.add(record(offset, b"k", 1))
    batch_py = reference.release_ready(0.0, 3, 3, 10)
    assert reference.ack(b"k", 1, batch_py[1].token) and reference.ack(b"k", 2, batch_py[2].token)
    assert reference.nack(b"k", 0, batch_py[0].token, 0.0, lambda failures: 0.0)
    [first] = reference.release_ready(0.0, 1, 1, 10)
    assert reference.ack(b"k", 0, first.token) and reference.watermark == 1
    # The next owner: 10 unsettled (the cascade's start), 11 and 12 settled before the crash; it
    # releases nothing until it has taken every record up to 14, the highest settled before: so the
    # flush that records 10's release carries the unsettling of every later record of its key.
    walk: PartitionCore[Record] = PartitionCore(ordered=True, settled_before={11, 12, 14})
    assert walk.add([record(10, b"k", 1), record(11, b"k", 1)]) == []
    assert walk.walking and walk.release_ready(0.0, 10, 1, 100)[0] == []
    assert walk.add([record(12, b"k", 1), record(14, b"j", 1)]) == [14]
    assert not walk.walking
    assert [r.offset for r in walk.release_ready(0.0, 10, 1, 100)[0]] == [10]
    assert walk.take_ops() == "u,11,0;u,12,0;D,10,1;"
    # A walk the fetch cannot finish (held over a buffer limit) lets releases go when told.
    held: PartitionCore[Record] = PartitionCore(ordered=True, settled_before={50})
    held.add([record(10, b"k", 1)])
    held.end_walk()
    assert [r.offset for r in held.release_ready(0.0, 10, 1, 100)[0]] == [10]
    assert held.take_ops() == "c,10,0;D,10,1;"  # its cascade is marked before anything goes out
    # Records that queue alone (an unordered subscription, or no ordering key) have nothing to
    # cascade over: no marks, and the commit point is not held.
    for ordered, key in ((False, b"k"), (True, None)):
        alone: PartitionCore[Record] = PartitionCore(ordered=ordered, settled_before={50})
        alone.add([record(10, key, 1), record(11, b"", 1)])
        alone.end_walk()
        assert len(alone.release_ready(0.0, 10, 1, 100)[0]) == 2
        assert "c," not in alone.take_ops() and alone.watermark == 10


def test_a_cascade_of_a_walk_ended_early_survives_a_crash() -> None:
    """SUB-4 across a crash during a walk ended early (the fetch held over a buffer limit): key k
    cascades from 10 (unsettled) over 12 (settled before the crash), which was not fetched yet when
    the walk ended. The owner marks k's cascade in Redis before releasing 10 and holds its commit
    point at the mark; it acks 10 and dies. Its successor, whose claim shows 10, 11, 12 settled and
    the mark, delivers 10 and 12 again, in order; the mark goes once its walk has ended."""
    keys = (b"k", b"j")
    owner = Twin(PartitionState(0, 1, ordered=True, settled_before=frozenset({11, 12})),
                 PartitionCore(ordered=True, settled_before={11, 12}), True)
    fetched = [record(10, keys[0], 1), record(11, keys[1], 1)]
    assert [owner.py.add(r) for r in fetched] == [True, False]
    assert owner.core.add(fetched) == [11]
    owner.end_walk()
    owner.release(10, 1, 100, False, False)
    owner.check()
    assert owner.deliveries[0][0] == 10
    owner.ack([(False, 0)])
    assert owner.core.watermark == owner.py.watermark == 10  # held at the mark, not 13
    owner.check()
    # Crash: Redis holds 10, 11, 12 settled and the mark 10.
    successor = Twin(PartitionState(0, 1, ordered=True, settled_before=frozenset({10, 11, 12}),
                                    cascades=frozenset({10})),
                     PartitionCore(ordered=True, settled_before={10, 11, 12}, cascades={10}), True)
    records = [record(10, keys[0], 1), record(11, keys[1], 1), record(12, keys[0], 1)]
    assert [successor.py.add(r) for r in records] == [True, False, True]
    successor.take_cascade_ops()
    assert successor.core.add(records) == [11]
    assert successor.ops == ["u,10,0;", "u,12,0;", "x,10,0;"]
    successor.check()
    for _ in range(2):
        successor.release(10, 1, 100, False, False)
        successor.ack([(False, 0)])
        successor.check()
    assert [d[0] for d in successor.deliveries] == [10, 12]
    assert successor.core.watermark == successor.py.watermark == 13


def test_a_seek_target_is_the_commit_point_until_records_arrive() -> None:
    """GRP-3: a core started at a seek's target commits the target until records arrive and takes
    nothing below it, as ``PartitionState`` does; ``ack_one`` settles one delivery as ``ack`` does."""
    state = PartitionState(0, 1, ordered=True, start_offset=7)
    core: PartitionCore[Record] = PartitionCore(ordered=True, start_offset=7)
    assert core.watermark == state.tracker.watermark == 7
    records = [record(offset, b"k", 1) for offset in (5, 6, 7, 8)]
    assert core.add(records) == [5, 6]
    assert [state.add(r) for r in records] == [False, False, True, True]
    assert core.watermark == state.tracker.watermark == 7
    released, tokens, _, _, _, _ = core.release_ready(0.0, 1, 1, 10)
    assert [r.offset for r in released] == [7]
    assert core.ack_one(7, tokens[0]) and not core.ack_one(7, tokens[0])
    assert (core.watermark, core.take_ops()) == (8, "D,7,1;a,7,2;")


def test_a_record_dead_lettered_after_a_rewind_passed_it_never_goes_out_again() -> None:
    """DLQ-2, SUB-4: a pull batch's first record is nacked while the second's dead letter is being
    written; the rewind puts both back, then the dead letter's report settles the second. It leaves
    its queue (the core and the reference alike): the key's next release is the first alone, and the
    commit point never passes a record that goes out again."""
    twin = Twin(PartitionState(0, 1, ordered=True), PartitionCore(ordered=True), True)
    twin.add([(0, 0, 1), (0, 0, 1)])  # offsets 0 and 1 of one key
    twin.release(10, 2, 100, False, False)
    twin.nack(twin.out(0), 0.0, False)
    twin.check()
    twin.dead_lettered((True, 0))  # the last delivery made: offset 1's
    twin.check()
    before = len(twin.deliveries)
    twin.release(10, 2, 100, False, False)
    twin.check()
    assert [d[0] for d in twin.deliveries[before:]] == [0]
    assert twin.core.watermark == twin.py.watermark == 0
    twin.ack([(False, 0)])
    twin.check()
    assert twin.core.watermark == 2 and twin.core.buffered == 0


def test_a_key_held_again_wakes_at_its_last_backoff() -> None:
    """DLQ-1, SUB-4: a key nacked twice while backing off (a pull batch of it outstanding) wakes at
    the end of the second backoff, not the first; both states agree at every step."""
    twin = Twin(PartitionState(0, 1, ordered=True), PartitionCore(ordered=True), True)
    twin.add([(0, 2, 1), (0, 2, 1), (0, 2, 1)])
    twin.release(10, 5, 100, lease=True, pooled=False)
    twin.nack((False, 2), 1.0, lapsed=False)  # offset 2: backoff 1 s
    twin.nack((False, 0), 1.0, lapsed=True)  # offset 0 (failure 2): backoff 2 s
    twin.check()
    twin.advance(1.0)
    twin.check()
    assert twin.core.ready_keys() == []
    twin.advance(1.0)
    twin.check()
    assert twin.core.ready_keys() == [b"a"]


def test_the_quarantine_hands_over_to_the_oldest_waiting_key() -> None:
    """DLQ-3, ACK-6: suspects of repeated crashes go out one at a time; the keys whose next record
    is quarantined wait in the order they were first turned away (a key looked at again keeps its
    place), and each settlement of the outstanding one (ack, lapse, give-back, dead letter) makes
    the oldest waiting key ready before the settled key itself; both states agree at every step."""
    charged = {0: 2, 1: 3, 2: 2}  # a, b, c: quarantined suspects; d (offset 3) is not a suspect
    twin = Twin(PartitionState(0, 1, ordered=True, attempts_before=charged),
                PartitionCore(ordered=True, attempts_before=charged), True)
    core = twin.core

    def step(name: str, *args: Any, **kwargs: Any) -> None:
        getattr(twin, name)(*args, **kwargs)
        twin.check()

    step("add", [(0, 2, 1), (0, 3, 1), (0, 4, 1), (0, 5, 1)])
    step("release", 10, 1, 100, lease=False, pooled=True)
    assert [(d[0], d[5]) for d in twin.deliveries] == [(0, 3), (3, 1)]
    assert (core.quarantined, core.waiting_keys()) == (0, [b"b", b"c"])
    step("add", [(0, 4, 1)])  # offset 4 of c: c is ready again, still waiting second
    step("release", 10, 1, 100, lease=False, pooled=True)
    assert core.waiting_keys() == [b"b", b"c"]
    step("ack", [twin.out(0)])
    assert core.ready_keys() == [b"b"]
    step("release", 10, 1, 100, lease=False, pooled=True)
    assert core.quarantined == 1
    step("nack", twin.out(1), 0.0, lapsed=True)
    assert core.ready_keys() == [b"c", b"b"]
    step("release", 10, 1, 100, lease=False, pooled=True)
    assert (core.quarantined, core.waiting_keys()) == (2, [b"b"])
    step("requeue", twin.out(2), 0.0, uncount=True)
    assert core.ready_keys() == [b"b", b"c"]
    step("release", 10, 5, 100, lease=True, pooled=True)
    assert (twin.deliveries[-1][0], twin.deliveries[-1][5], core.waiting_keys()) == (1, 5, [b"c"])
    step("dead_lettered", twin.out(1))
    assert (core.quarantined, core.ready_keys()) == (None, [b"c"])
    made = len(twin.deliveries)
    step("release", 10, 5, 100, lease=False, pooled=False)  # c's suspect alone, not with offset 4
    assert ([(d[0], d[5]) for d in twin.deliveries[made:]], core.quarantined) == ([(2, 3)], 2)


def test_a_batch_stops_before_a_quarantined_suspect_and_pull_mode_has_none() -> None:
    """DLQ-3, ACK-6: in callback mode a per-key batch goes out up to the first quarantined suspect
    that is not its head, which then goes out alone; without suspects (pull mode) the charged record
    keeps its attempts and goes out with the rest."""
    for suspects, batches in ((True, [[0, 1], [2], [3, 4]]), (False, [[0, 1, 2, 3, 4]])):
        charged = {2: 3}
        twin = Twin(PartitionState(0, 1, ordered=True, attempts_before=charged, suspects=suspects),
                    PartitionCore(ordered=True, attempts_before=charged, suspects=suspects), True)
        twin.add([(0, 2, 1)] * 5)
        for batch in batches:
            twin.release(10, 10, 100, lease=False, pooled=False)
            twin.check()
            released = twin.deliveries[-len(batch):]
            assert [(d[0], d[5]) for d in released] == [(o, 4 if o == 2 else 1) for o in batch]
            twin.ack([twin.out(o) for o in batch])
            twin.check()


def test_suspects_of_one_crash_go_out_together() -> None:
    """ACK-6, SUB-2: records charged fewer than ``QUARANTINE_FROM`` attempts are suspects that are not
    quarantined: they go out together, and the core names them (their starts are written before user
    code runs) as ``PartitionState`` flags them; a quarantined one goes out alone beside them."""
    charged = {0: 1, 1: 0, 2: 1, 3: 2, 4: 2}
    twin = Twin(PartitionState(0, 1, ordered=True, attempts_before=charged),
                PartitionCore(ordered=True, attempts_before=charged), True)
    twin.add([(0, 2, 1), (0, 2, 1), (0, 3, 1), (0, 4, 1), (0, 5, 1), (0, 6, 1)])
    records = [r for q in twin.py.keys.values() for r in q.records]
    _, _, attempts, _, suspects, _ = twin.core.release_ready(0.0, 100, 10, 100)
    expected = twin.py.release_ready(0.0, 100, 10, 100)
    assert [(d.record.offset, d.attempt) for d in expected] == [(0, 2), (1, 1), (2, 2), (3, 3), (5, 1)]
    assert attempts == [2, 1, 2, 3, 1]
    assert suspects == [0, 1, 2, 3]
    assert [r.quarantined for r in records] == [False, False, False, True, True, False]
    assert (twin.core.quarantined, twin.core.waiting_keys()) == (3, [b"d"])
    assert twin.py.quarantine.offset == 3 and list(twin.py.quarantine.waiting) == [b"d"]


def test_ready_counts_the_keys_a_release_could_take_and_none_during_the_walk() -> None:
    """SUB-7: ``ready`` (what the fetch's ``ample`` rule reads) counts the ready keys; a key with a
    record outstanding is not ready, a key acked is ready again, and a partition in its recovery walk
    has none ready (its releases are held), so that the fetch reads on to the walk's end."""
    core: PartitionCore[Record] = PartitionCore(ordered=True)
    assert core.add([record(0, b"a", 1), record(1, b"a", 1), record(2, b"b", 1), record(3, None, 1)]) == []
    assert core.ready == len(core.ready_keys()) == 3  # a, b and the unordered record 3
    _, tokens, _, _, _, _ = core.release_ready(0.0, 1, 1, 100)
    assert core.ready == 2  # a is out
    assert core.ack([0], tokens) == ([], 1)
    assert core.ready == 3  # a is ready again, with record 1
    walking: PartitionCore[Record] = PartitionCore(ordered=True, settled_before={5})
    assert walking.add([record(offset, b"k%d" % offset, 1) for offset in range(5)]) == []
    assert walking.walking and walking.ready == 0
    assert walking.add([record(5, b"k5", 1), record(6, b"k6", 1)]) == [5]
    assert not walking.walking and walking.ready == len(walking.ready_keys()) == 6
