"""Answers about outstanding deliveries applied to key queues, leases and queued ops (``Settlement``)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import cast

from ordering_layer.config import RetryPolicy, SubscriptionSettings
from ordering_layer.record import RecordMetadata
from ordering_layer.state import ApplyResult, StateStore
from ordering_layer.state.store import Op, OpKind, unpack_ops
from ordering_layer.subscriber.leases import lease_table
from ordering_layer.subscriber.message import AckResponse, Message
from ordering_layer.subscriber.owned_partition import OwnedPartition
from ordering_layer.subscriber.records import Record
from ordering_layer.subscriber.requests import DeadLettered, SettleKind
from ordering_layer.subscriber.settlement import REQUEUE_DELAY, Settlement
from ordering_layer.subscriber.state_writer import StateWriter

SETTINGS = SubscriptionSettings(topic="t", retry_policy=RetryPolicy(minimum_backoff=10, maximum_backoff=600))


class OpsStore:
    """Takes every write and keeps its ops per partition."""

    def __init__(self) -> None:
        self.ops: dict[int, list[Op]] = {}

    def apply_many(self, batches: Sequence[tuple[str, int, int, Sequence[Op]]]) -> list[ApplyResult]:
        for _, partition, _, ops in batches:
            self.ops.setdefault(partition, []).extend(ops)
        return [ApplyResult.APPLIED for _ in batches]

    def apply_packed(self, batches: Sequence[tuple[str, int, int, str]]) -> list[ApplyResult]:
        return self.apply_many([(s, p, e, unpack_ops(packed)) for s, p, e, packed in batches])


class Rig:
    """One owned partition (epoch 1) with records of keys ``a`` (offsets 0, 1) and ``b`` (offset 2)."""

    def __init__(self, suspects: bool = True) -> None:
        self.store = OpsStore()
        self.state = OwnedPartition(0, 1, ordered=True, suspects=suspects)
        self.owned = {0: self.state}
        self.leases = lease_table(SETTINGS)
        self.writer = StateWriter(cast(StateStore, self.store), "sub")
        self.counts = {"acked": 0, "nacked": 0}
        self.settlement = Settlement("sub", SETTINGS, self.owned, self.leases, self.writer, self.counts)
        self.state.add([Record(0, offset, key, b"x", None, RecordMetadata(None, 1, None), 1, 0)
                        for offset, key in enumerate([b"a", b"a", b"b"])])

    def release(self, now: float = 0.0, per_key: int = 1) -> list[Message]:
        """Release as the coordinator does: outstanding, and their attempts written before hand-out."""
        self.state.core.wake(now)
        batch, _ = self.state.release_ready(now, 10, per_key, 10**9, None, pooled=per_key == 1, leases=self.leases)
        self.written()
        return batch

    def written(self) -> list[Op]:
        assert self.writer.flush(self.owned) is not None
        return self.store.ops.pop(0, [])


def test_an_ack_settles_the_key_forgets_the_lease_and_queues_settled() -> None:
    """ACK-4, SUB-1: an ack settles its record (the key's next record is ready), drops its lease and queues
    SETTLED; its ``ack_with_response`` future learns SUCCESS once the op is written."""
    rig = Rig()
    first, _ = rig.release()
    future: Future[AckResponse] = Future()
    rig.settlement.settle(SettleKind.ACK, first, 1, 0.0, None, future, 1.0)
    assert not rig.leases.holds(first.lease) and rig.counts["acked"] == 1
    assert not future.done()
    # 2: its attempt is in a first-attempt run, no field to delete; the commit point rose to 1
    assert rig.written() == [(OpKind.SETTLED, 0, 2), (OpKind.FLOOR, 0, 1)]
    assert future.result(0) is AckResponse.SUCCESS
    assert [d.record.offset for d in rig.release(1.0)] == [1]


def test_answers_under_another_epoch_or_for_a_stale_token_change_nothing() -> None:
    """ACK-5: an ack made under an epoch that is no longer the partition's learns LEASE_LOST; one for a
    delivery given back since learns INVALID_ACK_ID; neither queues an op nor settles anything."""
    rig = Rig()
    first, _ = rig.release()
    lost: Future[AckResponse] = Future()
    rig.settlement.settle(SettleKind.ACK, first, 2, 0.0, None, lost, 1.0)
    assert lost.result(0) is AckResponse.LEASE_LOST
    rig.settlement.settle(SettleKind.NACK, first, 1, 0.0, None, None, 1.0)
    invalid: Future[AckResponse] = Future()
    rig.settlement.settle(SettleKind.ACK, first, 1, 0.0, None, invalid, 1.0)
    assert invalid.result(0) is AckResponse.INVALID_ACK_ID
    assert rig.counts == {"acked": 0, "nacked": 1}
    assert rig.written() == [(OpKind.NACKED, 0, 1)]


def test_a_nack_rewinds_the_key_backs_it_off_and_marks_the_attempt_started() -> None:
    """SUB-4, DLQ-1: a nack of a pull batch's first record gives back the whole batch of its key, holds
    the key for the retry policy's backoff (10 s), keeps the error, and queues NACKED with the attempt.
    In callback mode (a key's run handed to one worker) the records after the nacked one were never
    started: their attempts are taken back (DLQ-3)."""
    for suspects, later_attempt in ((False, 2), (True, 1)):
        check_a_nack_rewinds(Rig(suspects), later_attempt)


def check_a_nack_rewinds(rig: Rig, later_attempt: int) -> None:
    batch = rig.release(per_key=5)
    a0 = next(d for d in batch if d.record.offset == 0)
    rig.settlement.settle(SettleKind.NACK, a0, 1, 0.0, "boom", None, 1.0)
    assert a0.record.last_error == "boom" and not rig.leases.holds(a0.lease)
    assert rig.state.next_wake() == 11.0
    assert rig.written() == [(OpKind.NACKED, 0, 1)]
    assert [(d.record.offset, d.attempt) for d in rig.release(11.0, per_key=5)] == [(0, 2), (1, later_attempt)]


def test_a_deadline_change_keeps_the_lease_and_queues_its_new_deadline() -> None:
    """ACK-3: a new deadline is watched and written as a LEASE op; the delivery stays outstanding."""
    rig = Rig()
    first, _ = rig.release()
    future: Future[AckResponse] = Future()
    rig.settlement.settle(SettleKind.DEADLINE, first, 1, 60.0, None, future, 1.0)
    assert rig.leases.deadline_of(first.lease) == 61.0
    [(kind, offset, _)] = rig.written()
    assert (kind, offset) == (OpKind.LEASE, 0) and future.result(0) is AckResponse.SUCCESS


def test_start_notes_are_written_only_for_deliveries_still_outstanding() -> None:
    """ACK-6: a worker's start note is queued as STARTED; one whose delivery was settled in the same step
    is dropped (never written after SETTLED)."""
    rig = Rig()
    a0, b2 = rig.release()
    rig.settlement.starts.extend([a0, b2])
    rig.settlement.settle(SettleKind.ACK, b2, 1, 0.0, None, None, 1.0)
    rig.settlement.write_starts(1.0)
    assert not rig.settlement.starts
    assert rig.written() == [(OpKind.SETTLED, 2, 2), (OpKind.STARTED, 0, 1)]


def test_a_lapsed_lease_gives_the_delivery_back_as_a_nack_of_no_attempt() -> None:
    """ACK-1, SUB-4: at its deadline a lease lapses: the key is rewound and held, NACKED with value 0."""
    rig = Rig()
    rig.release()
    rig.settlement.expire(SETTINGS.ack_deadline + 1.0)
    assert rig.leases.count == 0
    assert sorted(rig.written()) == [(OpKind.NACKED, 0, 0), (OpKind.NACKED, 2, 0)]
    assert rig.state.next_wake() is not None


def test_dead_letter_reports_settle_or_give_back_without_a_failure() -> None:
    """DLQ-2: a dead letter the topic took settles its record (SETTLED, True); a refused one is given back,
    held ``REQUEUE_DELAY`` without counting a failure (False); a report of an old epoch changes nothing."""
    rig = Rig()
    a0, b2 = rig.release()
    assert not rig.settlement.dead_lettered(DeadLettered(0, 2, a0.queue_key, 0, None), 1.0)
    assert rig.settlement.dead_lettered(DeadLettered(0, 1, a0.queue_key, 0, None), 1.0)
    assert not rig.settlement.dead_lettered(DeadLettered(0, 1, b2.queue_key, 2, "refused"), 1.0)
    assert rig.written() == [(OpKind.SETTLED, 0, 0), (OpKind.FLOOR, 0, 1)]
    assert rig.state.next_wake() == 1.0 + REQUEUE_DELAY
    assert [d.record.offset for d in rig.release(1.0)] == [1]
    [again] = rig.release(1.0 + REQUEUE_DELAY)
    assert again.record.offset == 2 and again.attempt == 2
    rig.settlement.settle(SettleKind.NACK, again, 1, 0.0, None, None, 2.0)
    assert rig.state.next_wake() == 2.0 + SETTINGS.retry_policy.backoff(1)  # the refusal counted no failure


def test_give_back_takes_the_attempt_back_and_holds_the_key_briefly() -> None:
    """ACK-6: deliveries Redis did not record go back before anyone saw them: the attempt is not counted,
    the lease is forgotten, the key waits ``REQUEUE_DELAY`` and then the same attempt goes out again."""
    rig = Rig()
    batch = rig.release()
    assert rig.settlement.holds(batch[0], 1) and not rig.settlement.holds(batch[0], 2)
    rig.settlement.give_back([(rig.state, batch)], 5.0)
    assert rig.leases.count == 0 and not rig.settlement.holds(batch[0], 1)
    assert all(d.record.attempts == 0 for d in batch)
    assert [(d.record.offset, d.attempt) for d in rig.release(5.0 + REQUEUE_DELAY)] == [(0, 1), (2, 1)]


def test_give_back_without_a_delay_lets_the_keys_out_again_at_once() -> None:
    """ACK-6, SUB-1: messages released ahead of pulls that did not take them go back with their
    attempt taken back and their keys not held: the next release has them, the same attempt."""
    rig = Rig()
    batch = rig.release()
    rig.settlement.give_back([(rig.state, list(reversed(batch)))], 5.0, 0.0)
    assert rig.leases.count == 0
    assert sorted((d.record.offset, d.attempt) for d in rig.release(5.0)) == [(0, 1), (2, 1)]


def test_a_run_of_plain_acks_applies_in_one_pass_as_settle_would_one_by_one() -> None:
    """ACK-4, ACK-5: ``acks`` applies a run of plain acks (``Message.ack``) in order: each settles its
    record, drops its lease, feeds the ack latency and queues SETTLED; an ack made under another epoch,
    of a message given back since, or acked already, changes nothing."""
    rig = Rig()
    a0, b2 = rig.release()
    rig.settlement.settle(SettleKind.NACK, b2, 1, 0.0, None, None, 1.0)
    rig.state.epoch = 2  # the partition claimed again: an ack of a delivery made before changes nothing
    rig.settlement.acks([a0], 2.0)
    assert rig.leases.holds(a0.lease) and rig.counts["acked"] == 0
    rig.state.epoch = 1
    rig.settlement.acks([b2, a0, a0], 3.0)
    assert rig.counts == {"acked": 1, "nacked": 1}
    assert rig.leases.count == 0 and rig.leases.bytes == 0
    # 3: no lease to delete, no attempts field either (a first-attempt run has it); then the commit
    # point, risen to 1, as the floor
    assert rig.written() == [(OpKind.NACKED, 2, 1), (OpKind.SETTLED, 0, 3), (OpKind.FLOOR, 0, 1)]
    assert rig.leases.take_latencies() == [3.0]
    assert [d.record.offset for d in rig.release(3.0)] == [1]  # key a's next; key b backs off
