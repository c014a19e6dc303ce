"""Attempts charged after crashes (ACK-6, DLQ-3): released is not started.

The engine is driven without Kafka or Redis threads over a store that keeps the attempts and
settled keys as ``apply.lua`` does and answers claims as ``claim.lua`` does (parsed by the real
``parse_claim``). A "process" is an engine whose single callback worker takes the first message
handed to it; a crash is the engine abandoned without another step.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import cast

import pytest
from confluent_kafka import TopicPartition

from ordering_layer.config import DeadLetterPolicy, FlowControl, RetryPolicy, SubscriptionSettings
from ordering_layer.record import RecordMetadata
from ordering_layer.state import ApplyResult, ClaimedPartition, StateStore
from ordering_layer.state.store import Op, OpKind, parse_claim, unpack_ops
from ordering_layer.subscriber.engine import Engine
from ordering_layer.subscriber.message import Message
from ordering_layer.subscriber.partitions import charged_attempts
from ordering_layer.subscriber.records import Delivery, Record
from ordering_layer.subscriber.requests import DeadLettered, Pull

TOPIC = "orders"
P0 = [TopicPartition(TOPIC, 0)]
MAX_ATTEMPTS = 5
POISON = 0
KEYS = 12  # offset 0 is the poison (key k0); offsets 1..11 are the first messages of keys k1..k11


class RedisLike:
    """One partition's epoch, settled (with its floor), attempts and first-attempt runs, written as
    apply.lua writes them (a run per first attempt: ``runs.rs`` joins consecutive ones)."""

    pipelines = False  # flushes one at a time, through ``apply_packed``

    def __init__(self) -> None:
        self.epoch = 0
        self.settled: set[int] = set()
        self.floor = -1
        self.fields: dict[int, int] = {}  # the attempts hash
        self.firsts: set[tuple[int, int, int]] = set()  # (first, last, value)
        self.ops: list[Op] = []

    def claim(self, subscription: str, partition: int) -> ClaimedPartition:
        self.epoch += 1
        pairs = [str(v).encode() for item in self.fields.items() for v in item]
        runs = [f"{first},{last},{value}".encode() for first, last, value in sorted(self.firsts)]
        return parse_claim([self.epoch, *(str(o).encode() for o in sorted(self.settled)), b"|", *pairs,
                            b"|", b"0", b"-1", b"|", b"|", str(self.floor).encode(), b"|", *runs])

    @property
    def attempts(self) -> dict[int, int]:
        """The attempt recorded of each offset, as a claim reads it: its field, else (unsettled) its run's."""
        acked, recorded = self.acked(), dict[int, int]()
        for first, last, value in self.firsts:
            for offset in range(first, last + 1):
                if offset not in acked:
                    recorded[offset] = max(value, recorded.get(offset, value))
        return recorded | self.fields

    def acked(self) -> set[int]:
        """Every offset Redis has settled: those below the floor and the settled set's."""
        return set(range(self.floor)) | self.settled

    def apply_many(self, batches: Sequence[tuple[str, int, int, Sequence[Op]]]) -> list[ApplyResult]:
        results = []
        for _, _, epoch, ops in batches:
            if epoch < self.epoch:
                results.append(ApplyResult.FENCED)
                continue
            for kind, offset, value in ops:
                self.ops.append((kind, offset, value))
                if kind in (OpKind.DELIVERED, OpKind.BATCH_DELIVERED, OpKind.STARTED) or (
                        kind == OpKind.NACKED and value):
                    self.fields[offset] = value
                elif kind in (OpKind.RELEASED, OpKind.BATCH_RELEASED):
                    self.fields[offset] = -value
                elif kind in (OpKind.FIRST_DELIVERED, OpKind.BATCH_FIRST_DELIVERED):
                    self.firsts.add((offset, offset, value))
                elif kind in (OpKind.FIRST_RELEASED, OpKind.BATCH_FIRST_RELEASED):
                    self.firsts.add((offset, offset, -value))
                elif kind == OpKind.SETTLED:
                    self.settled.add(offset)
                    if not value & 2:
                        self.fields.pop(offset, None)
                elif kind == OpKind.FLOOR:
                    self.floor = max(self.floor, value)
                    self.settled = {o for o in self.settled if o >= self.floor}
                    self.firsts = {run for run in self.firsts if run[1] >= self.floor}
            results.append(ApplyResult.APPLIED)
        return results

    def apply_packed(self, batches: Sequence[tuple[str, int, int, str]]) -> list[ApplyResult]:
        return self.apply_many([(s, p, e, unpack_ops(packed)) for s, p, e, packed in batches])

    def parked_keys(self, subscription: str) -> set[bytes]:
        return set()

    def seek_announced(self, subscription: str) -> int:
        return 0

    def claim_for_seek(self, subscription: str, epochs: Mapping[int, int]) -> dict[int, ClaimedPartition | None]:
        return {}


def records() -> list[Record]:
    return [Record(0, o, b"k%d" % o, b"x", [], RecordMetadata(None, 1, None), 1, 0) for o in range(KEYS)]


class Process:
    """One subscriber process in callback mode: an engine that owns partition 0."""

    def __init__(self, store: RedisLike, *, pull: bool = False, dead_letters: bool = True) -> None:
        self.handed: list[Message] = []
        settings = SubscriptionSettings(topic=TOPIC, retry_policy=RetryPolicy(minimum_backoff=0, maximum_backoff=0),
                                        dead_letter_policy=DeadLetterPolicy("dlq", MAX_ATTEMPTS) if dead_letters
                                        else None)
        self.engine = Engine({"bootstrap.servers": "127.0.0.1:1"}, cast(StateStore, store), "sub", settings,
                             flow_control=FlowControl(), on_messages=None if pull else self.handed.extend)
        self.dead: list[tuple[int, int]] = []  # (offset, attempt) sent to the dead-letter topic

        def write(delivery: Delivery, epoch: int, reason: str) -> None:
            self.dead.append((delivery.record.offset, delivery.attempt))
            record = delivery.record  # the dead-letter topic takes it at once
            self.engine._inbox.put(DeadLettered(record.partition, epoch, delivery.queue_key, record.offset, None))

        self.engine._dead_letters.write = write  # type: ignore[method-assign]
        self.engine._fetcher._on_assign(self.engine.consumer, P0)
        self.engine._handle([self.engine._fetcher.fetched(records())], time.monotonic())

    def step(self) -> None:
        """One coordinator step, then a flush of what it queued (a step flushes only when due)."""
        self.engine._step()
        self.engine._flushes.flush()

    def crash(self) -> None:
        self.engine.consumer.close()


def attempts_of(handed: list[Message]) -> dict[int, int]:
    return {m.offset(): m.delivery_attempt for m in handed}


def test_a_crashing_poison_is_dead_lettered_alone_after_exactly_max_attempts() -> None:
    """DLQ-3, ACK-6: a poison that crashes the process on every start, released with 11 other keys'
    first messages that wait in the pool (one worker), crashes exactly 5 processes (attempts 1..5),
    then goes to the dead-letter topic as attempt 6 (5 attempts). The others were never started:
    after the first crash they go out again with the poison (suspects of one crash go out
    together); charged for two crashes, they wait, quarantined, while the poison, quarantined too,
    goes out alone, and reach user code one at a time in the sixth process (attempt 3)."""
    store = RedisLike()
    poison_attempts = []
    for n in range(MAX_ATTEMPTS):
        process = Process(store)
        process.step()
        assert sorted(attempts_of(process.handed)) == (list(range(KEYS)) if n < 2 else [POISON])
        first = process.handed[0]
        assert first.offset() == POISON
        poison_attempts.append(first.delivery_attempt)
        assert process.engine.begin(first)  # the worker starts user code: it crashes the process
        process.crash()
    assert poison_attempts == [1, 2, 3, 4, 5]
    # attempts 2..5 were suspects: their start reached Redis before user code ran.
    assert [(k, v) for k, o, v in store.ops if k == OpKind.STARTED and o == POISON] == [
        (OpKind.STARTED, n) for n in range(2, MAX_ATTEMPTS + 1)]

    last = Process(store)
    last.step()
    assert last.dead == [(POISON, MAX_ATTEMPTS + 1)]
    for offset in range(1, KEYS):
        last.step()
        assert attempts_of(last.handed[offset - 1:]) == {offset: 3}
        assert last.engine.begin(last.handed[-1])
        last.handed[-1].ack()
    last.step()
    assert store.acked() == set(range(KEYS)) and last.dead == [(POISON, MAX_ATTEMPTS + 1)]
    last.crash()


def test_an_unstarted_attempt_counts_but_never_reaches_the_limit() -> None:
    """ACK-6, DLQ-3: at a claim a started attempt counts in full, an attempt never seen started counts
    up to max_delivery_attempts - 1; beyond the limit (a dead letter in flight, written again by the
    next owner) it counts as the limit, started or not."""
    claimed = parse_claim([7, b"3", b"|", b"10", b"2", b"11", b"-2", b"12", b"-5", b"13", b"5", b"14", b"-6",
                           b"15", b"7"])
    assert (claimed.epoch, claimed.settled) == (7, frozenset({3}))
    assert claimed.attempts == {10: 2, 11: 2, 12: 5, 13: 5, 14: 6, 15: 7}
    assert claimed.unstarted == frozenset({11, 12, 14})
    assert charged_attempts(claimed, 5) == {10: 2, 11: 2, 12: 4, 13: 5, 14: 5, 15: 5}
    assert charged_attempts(claimed, None) == claimed.attempts
    started_only = parse_claim([8, b"|", b"20", b"6"])
    assert charged_attempts(started_only, 5) == {20: 5}
    assert claimed.floor is None and started_only.floor is None
    floored = parse_claim([9, b"12", b"|", b"|", b"2", b"-1", b"|", b"5", b"|", b"10"])
    assert (floored.settled, floored.seek_generation, floored.seek_offset) == (frozenset({12}), 2, None)
    assert (floored.cascades, floored.floor) == (frozenset({5}), 10)


def test_a_claim_reads_each_stretch_of_a_first_attempt_member() -> None:
    """ACK-6, DLQ-3: a batch's first attempts of one value are one member listing its stretches of
    consecutive offsets; a claim charges every unsettled offset of every stretch at or above the floor
    that attempt (a field of its own comes first, and of two members the one user code had), and no
    offset between the stretches. A member of one stretch reads as before."""
    claimed = parse_claim([4, b"21", b"|", b"22", b"3", b"|", b"0", b"-1", b"|", b"|", b"12", b"|",
                           b"10,14,20,22,30,30,-1", b"29,30,1", b"40,40,1"])
    assert claimed.attempts == {12: 1, 13: 1, 14: 1, 20: 1, 22: 3, 29: 1, 30: 1, 40: 1}
    assert claimed.unstarted == frozenset({12, 13, 14, 20})
    with pytest.raises(ValueError):
        parse_claim([4, b"|", b"|", b"0", b"-1", b"|", b"|", b"-1", b"|", b"10,14,20,-1"])  # a stretch cut short


def test_a_suspect_that_starts_and_crashes_is_charged_in_full() -> None:
    """ACK-6: a message handed out before a crash records its start before user code runs, so a crash
    while it runs counts even though the coordinator never flushed again; a message that started
    at a process without being a suspect counts in full once its start note was flushed."""
    store = RedisLike()
    first = Process(store)
    first.step()
    assert first.engine.begin(first.handed[1])  # a note, written with the next flush
    first.step()
    first.crash()
    assert store.attempts[1] == 1 and store.attempts[2] == -1

    second = Process(store)
    second.step()
    assert attempts_of(second.handed) == dict.fromkeys(range(KEYS), 2)  # one crash's suspects: together
    assert second.engine.begin(second.handed[0])  # a suspect: written at once
    assert store.attempts[0] == 2
    second.crash()

    third = Process(store)
    third.step()
    assert attempts_of(third.handed) == {0: 3}  # charged for two crashes: one at a time
    third.crash()


def test_a_start_is_not_written_after_the_settle_and_a_stale_suspect_does_not_run() -> None:
    """ACK-5, ACK-6: a start noted for a delivery acked in the same step is dropped (no attempts entry
    comes back after SETTLED); a suspect whose delivery was given back before a worker took it does
    not run (its redelivery does)."""
    store = RedisLike()
    first = Process(store)
    first.step()
    first.crash()
    second = Process(store)
    second.step()
    plain_before = len(store.ops)
    message = second.handed[0]
    assert second.engine.begin(message)
    message.ack()
    second.step()
    assert 0 in store.acked() and 0 not in store.attempts
    assert [op for op in store.ops[plain_before:] if op[0] == OpKind.STARTED and op[1] == 0] == [
        (OpKind.STARTED, 0, 2)]
    given_back = second.handed[1]
    given_back.nack()
    second.step()
    assert not second.engine.begin(given_back)
    second.crash()


def test_a_nack_marks_its_attempt_started() -> None:
    """ACK-6: a nack comes from user code, so it marks its attempt started (NACKED carries it) even when
    the worker's start note is dropped because the nack arrived in the same step."""
    store = RedisLike()
    process = Process(store)
    process.step()
    message = process.handed[1]
    assert process.engine.begin(message)
    message.nack()
    process.step()
    ops = [op for op in store.ops if op[1] == 1 and op[0] != OpKind.LEASE]
    assert ops == [(OpKind.FIRST_RELEASED, 1, 1), (OpKind.NACKED, 1, 1), (OpKind.RELEASED, 1, 2)]
    process.crash()


def test_without_a_dead_letter_policy_no_start_is_written_and_every_attempt_counts() -> None:
    """ACK-6: a start note only keeps an unseen attempt from being charged up to the dead-letter limit;
    without a policy none is written, and a crash charges each released attempt in full, started
    or not, as a note would."""
    store = RedisLike()
    first = Process(store, dead_letters=False)
    first.step()
    assert first.engine.begin(first.handed[1])
    first.step()
    assert not [op for op in store.ops if op[0] == OpKind.STARTED]
    first.crash()
    second = Process(store, dead_letters=False)
    second.step()
    assert attempts_of(second.handed) == dict.fromkeys(range(KEYS), 2)
    second.crash()


def test_a_pull_counts_the_release_as_the_start() -> None:
    """ACK-6: a pull hands messages to user code at release: a crash after a pull charges them in full."""
    store = RedisLike()
    process = Process(store, pull=True)
    process.engine._worker.start()
    try:
        pulled = process.engine.pull(KEYS, 5.0)
    finally:
        process.engine._worker.stop()
    assert len(pulled) == KEYS
    assert store.attempts == {o: 1 for o in range(KEYS)}
    process.crash()
    again = Process(store, pull=True)
    state = again.engine._partitions[0]
    batch, _ = state.release_ready(0.0, KEYS, 1, 10**9, None, pooled=False)
    assert [d.attempt for d in batch] == [2] * KEYS  # charged 1 each
    again.crash()


def pull_one(process: Process, *, then_step: bool = True) -> Message:
    """A pull of one message, answered by the coordinator's steps (released ahead: at once), and
    (``then_step``) the step its flush's answer wakes, which releases ahead of the next pull and
    writes the start notes of the deliveries still outstanding."""
    pull = Pull(1, time.monotonic() + 5.0, Future())
    process.engine._inbox.put(pull)
    for _ in range(5):
        process.step()
        if pull.future.done():
            if then_step:
                process.step()
            [message] = pull.future.result()
            return message
    raise AssertionError("the pull was not answered")


def test_a_poison_pulled_from_those_released_ahead_is_dead_lettered_after_exactly_max_attempts() -> None:
    """DLQ-3, ACK-6 (pull mode): one at a time, each message is pulled from those released ahead
    (queued as released, not started) and acked; the poison (offset 5) crashes its puller before its
    start note reaches Redis, so that first attempt counts but is capped below the limit. A new owner
    releases a partition with charged attempts only to a waiting pull, as delivered (nothing goes
    ahead, even a step later), so each later crash counts in full: attempts 1..5, then the
    dead-letter topic. The messages released ahead when the poison crashed were never pulled: each is
    charged that one attempt, never more, and goes out as attempt 2."""
    store = RedisLike()
    process = Process(store, pull=True)
    for offset in range(5):
        message = pull_one(process)
        assert message.offset() == offset
        assert store.attempts[offset + 1] == -1  # released ahead of the next pull
        message.ack()
    poison = pull_one(process, then_step=False)
    assert (poison.offset(), poison.delivery_attempt) == (5, 1)
    assert store.attempts[5] == -1  # pulled from those released ahead: its start is not written yet
    assert store.attempts[6] == -1  # released ahead of the next pulls, never pulled
    ahead = {offset for offset in range(6, KEYS) if store.attempts.get(offset) == -1}
    process.crash()
    attempts = [1]
    for _ in range(MAX_ATTEMPTS - 1):
        process = Process(store, pull=True)
        poison = pull_one(process)
        assert poison.offset() == 5 and store.attempts[6] == -1  # charged: nothing released ahead
        attempts.append(poison.delivery_attempt)
        assert store.attempts[5] == poison.delivery_attempt  # written as started before the pull returned
        process.crash()
    assert attempts == [1, 2, 3, 4, 5]
    last = Process(store, pull=True)
    for offset in range(6, KEYS):
        message = pull_one(last)
        assert (message.offset(), message.delivery_attempt) == (offset, 2 if offset in ahead else 1)
        message.ack()
    assert last.dead == [(5, MAX_ATTEMPTS + 1)]
    last.step()
    assert store.acked() == set(range(KEYS))
    last.crash()
