"""Pure dispatch logic of a partition: per-key hold queues, cascade bookkeeping, recovery walk."""

from __future__ import annotations

from ordering_layer.config import RetryPolicy
from ordering_layer.record import RecordMetadata
from ordering_layer.subscriber.records import Record
from tests.model.partition import PartitionState

NO_BACKOFF = RetryPolicy(0, 0).backoff


def record(offset: int, key: bytes | None, partition: int = 0) -> Record:
    return Record(partition, offset, key, b"x", [], RecordMetadata(None, 1, None), 1, 0)


def fill(state: PartitionState, keys: list[bytes | None], start: int = 0) -> None:
    for offset, key in enumerate(keys, start):
        state.add(record(offset, key))


def release_all(state: PartitionState, limit: int = 1) -> list[tuple[bytes | int, int, int]]:
    """(queue key, offset, token) of everything releasable now."""
    return [(d.queue_key, d.record.offset, d.token) for d in state.release_ready(0.0, 10**9, limit, 10**9)]


def test_one_outstanding_per_key_and_keys_independent() -> None:
    """SUB-1, SUB-2: one message per key at a time, in order; other keys are not held back."""
    state = PartitionState(0, 1, ordered=True)
    fill(state, [b"a", b"b", b"a", b"b", b"a"])
    first = release_all(state)
    assert [(k, o) for k, o, _ in first] == [(b"a", 0), (b"b", 1)]
    assert release_all(state) == []
    assert state.ack(b"b", 1, first[1][2])
    second = release_all(state)
    assert [(k, o) for k, o, _ in second] == [(b"b", 3)]
    assert state.ack(b"a", 0, first[0][2])
    assert [(k, o) for k, o, _ in release_all(state)] == [(b"a", 2)]
    assert state.tracker.watermark == 2


def test_nack_rewinds_key_and_cascades_acked_messages() -> None:
    """SUB-4: a nack of m redelivers m and every later delivered message of its key, acked ones too."""
    state = PartitionState(0, 1, ordered=True)
    fill(state, [b"k", b"k", b"k", b"k", b"other"])
    batch = release_all(state, limit=10)
    assert [o for _, o, _ in batch] == [0, 1, 2, 3, 4]
    tokens = {o: t for _, o, t in batch}
    assert state.ack(b"k", 2, tokens[2])
    assert state.ack(b"k", 3, tokens[3])
    assert state.ack(b"other", 4, tokens[4])
    assert state.nack(b"k", 1, tokens[1], 0.0, NO_BACKOFF)
    assert not state.ack(b"k", 3, tokens[3]), "a stale token is refused"
    assert release_all(state, limit=10) == [], "offset 0 is still outstanding: one batch per key"
    assert state.ack(b"k", 0, tokens[0])
    again = release_all(state, limit=10)
    assert [o for _, o, _ in again] == [1, 2, 3]
    assert state.tracker.watermark == 1


def test_backoff_holds_only_its_key() -> None:
    """DLQ-1: after a nack the key waits out its backoff; other keys do not."""
    state = PartitionState(0, 1, ordered=True)
    fill(state, [b"slow", b"fast", b"fast"])
    first = {k: t for k, _, t in release_all(state)}
    assert state.nack(b"slow", 0, first[b"slow"], 100.0, RetryPolicy(10, 600).backoff)
    assert state.ack(b"fast", 1, first[b"fast"])
    assert [k for k, _, _ in release_all(state)] == [b"fast"]
    assert state.next_wake() == 110.0
    state.wake(109.0)
    assert b"slow" not in state.ready
    state.wake(110.0)
    assert b"slow" in state.ready


def test_recovery_walk_skips_settled_keys_and_cascades_the_rest() -> None:
    """SUB-3, SUB-4: after a crash, keys whose records are settled are skipped; a key with an
    unsettled record is delivered from it on, later settled records included."""
    settled = frozenset({0, 1, 3, 4})
    state = PartitionState(0, 2, ordered=True, settled_before=settled, attempts_before={2: 1})
    fill(state, [b"done", b"k", b"k", b"k", b"done2", b"new"])
    released = release_all(state)
    assert [(k, o) for k, o, _ in released] == [(b"k", 2), (b"new", 5)]
    delivery_attempts = state.keys[b"k"].records[0].attempts
    assert delivery_attempts == 2, "attempts survive the crash (ACK-6)"
    assert state.ack(b"k", 2, released[0][2])
    assert [(k, o) for k, o, _ in release_all(state)] == [(b"k", 3)], "settled 3 is redelivered: k cascades"
    assert state.tracker.watermark == 3


def test_unordered_records_are_independent() -> None:
    """SUB-6: without ordering every record is released at once, even of one key."""
    state = PartitionState(0, 1, ordered=False)
    fill(state, [b"k", b"k", b"k"])
    assert [o for _, o, _ in release_all(state)] == [0, 1, 2]


def test_retry_policy_backoff_doubles_within_bounds() -> None:
    """DLQ-1: exponential backoff between minimum and maximum."""
    policy = RetryPolicy(minimum_backoff=10, maximum_backoff=600)
    assert [policy.backoff(n) for n in range(1, 9)] == [10, 20, 40, 80, 160, 320, 600, 600]
    assert policy.backoff(0) == 0


def test_release_ready_respects_message_and_byte_budgets_and_keeps_the_rest_ready() -> None:
    """SUB-7: a step releases at most the budgets allow; unreleased keys stay ready, oldest first."""
    state = PartitionState(0, 1, ordered=True)
    fill(state, [b"a", b"b", b"c", b"d"])
    first = state.release_ready(0.0, 2, 1, 10**9)
    assert [(d.queue_key, d.record.offset) for d in first] == [(b"a", 0), (b"b", 1)]
    assert list(state.ready) == [b"c", b"d"]
    # each record here is 1 byte: a byte budget of 1 lets one key go, then stops
    assert [(d.queue_key, d.record.offset) for d in state.release_ready(0.0, 10, 1, 1)] == [(b"c", 2)]
    assert list(state.ready) == [b"d"]


def test_release_ready_in_pull_mode_hands_out_a_batch_per_key() -> None:
    """SUB-1 (pull): one batch per key, in offset order, cut at the budget."""
    state = PartitionState(0, 1, ordered=True)
    fill(state, [b"a", b"a", b"b", b"a", b"b"])
    batch = state.release_ready(0.0, 4, 10, 10**9)
    assert [(d.queue_key, d.record.offset) for d in batch] == [(b"a", 0), (b"a", 1), (b"a", 3), (b"b", 2)]
    assert state.release_ready(0.0, 10, 10, 10**9) == []


def test_requeue_rewinds_without_counting_a_failure() -> None:
    """DLQ-1, SUB-4: a delivery given back because a Redis or dead-letter write failed is redelivered
    (its key rewound, after the given delay) but is no failure: the next nack backs off by the first
    step (10 s), not the second (20 s)."""
    state = PartitionState(0, 1, ordered=True)
    fill(state, [b"k", b"k"])
    (qkey, offset, token), = release_all(state)
    assert state.requeue(qkey, offset, token, 100.0, 1.0)
    assert not state.requeue(qkey, offset, token, 100.0, 1.0)  # the token is stale now
    assert state.keys[b"k"].failures == 0
    assert state.next_wake() == 101.0
    state.wake(101.0)
    deliveries = state.release_ready(101.0, 10, 1, 10**9)
    assert [(d.record.offset, d.attempt) for d in deliveries] == [(0, 2)]
    assert state.nack(b"k", 0, deliveries[0].token, 200.0, RetryPolicy(10, 600).backoff)
    assert state.next_wake() == 210.0


def test_backoff_wakes_keys_in_due_time_order() -> None:
    """DLQ-1: a nacked key waits out its backoff (due-time heap), other keys do not (SUB-2); a key held
    again with no delay is ready at once."""
    state = PartitionState(0, 1, ordered=True)
    fill(state, [b"a", b"b", b"c"])
    (qa, oa, ta), (qb, ob, tb), _ = release_all(state)
    assert state.nack(qa, oa, ta, 0.0, lambda failures: 5.0)
    assert state.nack(qb, ob, tb, 0.0, lambda failures: 2.0)
    assert state.next_wake() == 2.0
    state.wake(1.0)
    assert release_all(state) == []
    state.wake(2.0)
    assert [d.queue_key for d in state.release_ready(2.0, 10, 1, 10**9)] == [b"b"]
    assert state.held_keys() == 3  # a backing off, b and c outstanding
    state.wake(5.0)
    assert [d.queue_key for d in state.release_ready(5.0, 10, 1, 10**9)] == [b"a"]


def released(state: PartitionState, limit: int = 1) -> dict[bytes | int, tuple[int, int]]:
    """Queue key -> (offset, token) of everything releasable now (one per key)."""
    return {d.queue_key: (d.record.offset, d.token) for d in state.release_ready(0.0, 10**9, limit, 10**9)}


def test_suspects_of_one_crash_go_out_together() -> None:
    """ACK-6, SUB-2: records charged one attempt (out when one owner crashed) are suspects, not
    quarantined: they go out together, each start to be written before user code runs; a record
    charged two attempts is quarantined and goes out alone beside them."""
    state = PartitionState(0, 1, ordered=True, attempts_before={0: 1, 1: 1, 2: 1, 3: 2, 4: 2})
    fill(state, [b"s1", b"s2", b"s3", b"q1", b"q2", b"a"])
    deliveries = state.release_ready(0.0, 100, 1, 10**9)
    assert [(d.queue_key, d.record.offset, d.attempt) for d in deliveries] == [
        (b"s1", 0, 2), (b"s2", 1, 2), (b"s3", 2, 2), (b"q1", 3, 3), (b"a", 5, 1)]
    assert [d.record.suspect for d in deliveries] == [True, True, True, True, False]
    assert [d.record.quarantined for d in deliveries] == [False, False, False, True, False]
    assert list(state.quarantine.waiting) == [b"q2"]


def test_quarantined_suspects_go_out_one_at_a_time_while_other_keys_flow() -> None:
    """DLQ-3, ACK-6, SUB-2: of three suspects charged for two crashes (keys s1, s2, s3) one is
    outstanding at a time, while keys a and b flow; an ack, a nack, a give-back (requeue) or a dead
    letter of the outstanding suspect lets the next one out, oldest waiting first."""
    state = PartitionState(0, 1, ordered=True, attempts_before={0: 2, 2: 2, 4: 2})
    fill(state, [b"s1", b"a", b"s2", b"b", b"s3", b"a", b"b"])
    first = released(state)
    assert {k: o for k, (o, _) in first.items()} == {b"s1": 0, b"a": 1, b"b": 3}
    assert list(state.quarantine.waiting) == [b"s2", b"s3"] and not state.ready
    assert released(state) == {}
    assert state.ack(b"a", 1, first[b"a"][1]) and state.ack(b"b", 3, first[b"b"][1])
    assert {k: o for k, (o, _) in released(state).items()} == {b"a": 5, b"b": 6}  # not held by s1

    assert state.ack(b"s1", 0, first[b"s1"][1])
    (key, (offset, token)), = released(state).items()
    assert (key, offset) == (b"s2", 2)
    assert state.nack(key, offset, token, 0.0, NO_BACKOFF)
    (key, (offset, token)), = released(state).items()
    assert (key, offset) == (b"s3", 4)
    assert list(state.quarantine.waiting) == [b"s2"]
    assert state.requeue(key, offset, token, 0.0, 0.0)  # given back: Redis did not take its attempt
    (key, (offset, token)), = released(state).items()
    assert (key, offset) == (b"s2", 2)
    state.settle_dead_lettered(key, offset)
    deliveries = state.release_ready(0.0, 10, 1, 10**9)
    assert [(d.queue_key, d.record.offset, d.attempt) for d in deliveries] == [(b"s3", 4, 4)]
    assert state.ack(b"s3", 4, deliveries[0].token)
    assert state.quarantine.offset is None and not state.quarantine.waiting
    assert state.tracker.watermark == 5


def test_a_quarantined_suspect_goes_out_alone_in_batches() -> None:
    """DLQ-3, SUB-1 (batches of one key): a key whose next record is quarantined is released as a
    batch of one, and only while no other quarantined record is out; a batch of other records ends
    before a quarantined one."""
    state = PartitionState(0, 1, ordered=True, attempts_before={0: 2, 1: 2, 2: 2, 6: 2})
    fill(state, [b"s", b"s", b"t", b"a", b"a", b"n", b"n"])
    batch = state.release_ready(0.0, 100, 10, 10**9)
    assert [(d.queue_key, d.record.offset) for d in batch] == [(b"s", 0), (b"a", 3), (b"a", 4), (b"n", 5)]
    assert list(state.quarantine.waiting) == [b"t"]
    tokens = {d.record.offset: d.token for d in batch}
    assert state.ack(b"s", 0, tokens[0])
    (t2,) = state.release_ready(0.0, 100, 10, 10**9)
    assert (t2.queue_key, t2.record.offset) == (b"t", 2)
    assert state.ack(b"n", 5, tokens[5])
    assert state.release_ready(0.0, 100, 10, 10**9) == []
    assert list(state.quarantine.waiting) == [b"s", b"n"]
    assert state.ack(b"t", 2, t2.token)
    (s1,) = state.release_ready(0.0, 100, 10, 10**9)
    assert (s1.queue_key, s1.record.offset, s1.attempt) == (b"s", 1, 3)
    assert state.ack(b"s", 1, s1.token)
    assert [(d.queue_key, d.record.offset) for d in state.release_ready(0.0, 100, 10, 10**9)] == [(b"n", 6)]


def test_pull_mode_has_no_suspects() -> None:
    """ACK-6, SUB-2 (pull): records charged at a claim keep their attempts but are not suspects when
    the partition serves pulls: they go out together, as a pull may hold a batch while it pulls again."""
    state = PartitionState(0, 1, ordered=True, attempts_before={0: 1, 1: 1, 2: 1}, suspects=False)
    fill(state, [b"s", b"t", b"u", b"a"])
    batch = state.release_ready(0.0, 100, 10, 10**9)
    assert [(d.queue_key, d.record.offset, d.attempt) for d in batch] == [
        (b"s", 0, 2), (b"t", 1, 2), (b"u", 2, 2), (b"a", 3, 1)]
    assert not any(d.record.suspect for d in batch)

