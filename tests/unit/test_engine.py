"""The engine's handling of fetched records and of failed writes, driven without Kafka or Redis threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import cast

import pytest
import redis
from confluent_kafka import Consumer, TopicPartition

from ordering_layer._core import AckQueue, LeaseTable, NativeFetch, ack_queued_all, unsettled
from ordering_layer.config import FlowControl, RetryPolicy, SubscriptionSettings
from ordering_layer.record import RecordMetadata
from ordering_layer.state import ApplyResult, StateStore
from ordering_layer.state.store import ClaimedPartition, Op, OpKind, unpack_ops
from ordering_layer.subscriber.engine import Engine
from ordering_layer.subscriber.flow import Gate
from ordering_layer.subscriber.handoff import AHEAD_AT_LEAST
from ordering_layer.subscriber.message import NACKED, Message, ack_all
from ordering_layer.subscriber.owned_partition import OwnedPartition
from ordering_layer.subscriber.records import Delivery, Record
from ordering_layer.subscriber.requests import DeadLettered, Pull
from ordering_layer.subscriber.settlement import REQUEUE_DELAY
from tests.checker import wait_until

TOPIC = "orders"
P0 = [TopicPartition(TOPIC, 0)]


class FakeStore:
    """Claims hand out increasing epochs and nothing settled; writes succeed unless ``failing``."""

    pipelines = False  # flushes one at a time, through ``apply_packed``

    def __init__(self) -> None:
        self.epoch = 0
        self.failing = False
        self.settled: frozenset[int] = frozenset()  # what a claim finds settled
        self.cascades: frozenset[int] = frozenset()  # the cascade marks a claim finds
        self.op_log: list[tuple[int, Op]] = []  # (partition, op) of every batch applied, in order

    def claim(self, subscription: str, partition: int) -> ClaimedPartition:
        self.epoch += 1
        return ClaimedPartition(self.epoch, self.settled, {}, cascades=self.cascades)

    def apply_many(self, batches: Sequence[tuple[str, int, int, Sequence[Op]]]) -> list[ApplyResult]:
        if self.failing:
            raise redis.ConnectionError("Redis is down")
        self.op_log.extend((partition, op) for _, partition, _, ops in batches for op in ops)
        return [ApplyResult.APPLIED for _ in batches]

    def apply_packed(self, batches: Sequence[tuple[str, int, int, str]]) -> list[ApplyResult]:
        return self.apply_many([(s, p, e, unpack_ops(packed)) for s, p, e, packed in batches])

    def parked_keys(self, subscription: str) -> set[bytes]:
        return set()

    def seek_announced(self, subscription: str) -> int:
        return 0

    def claim_for_seek(self, subscription: str, epochs: Mapping[int, int]) -> dict[int, ClaimedPartition | None]:
        return {}


def record(offset: int, partition: int = 0, keys: int = 3) -> Record:
    """A fetched record of key ``key-<offset % keys>``."""
    return Record(partition, offset, b"key-%d" % (offset % keys), b"x", [], RecordMetadata(None, 1, None), 1, 0)


@pytest.fixture
def store() -> FakeStore:
    return FakeStore()


SETTINGS = SubscriptionSettings(topic=TOPIC, retry_policy=RetryPolicy(minimum_backoff=10, maximum_backoff=600))


def make_engine(store: FakeStore, on_messages: Callable[[list[Message]], None] | None = None) -> Engine:
    """An engine whose consumer never reaches a broker; its threads are not started (tests drive it)."""
    return Engine({"bootstrap.servers": "127.0.0.1:1"}, cast(StateStore, store), "sub", SETTINGS,
                  flow_control=FlowControl(), on_messages=on_messages)


def step(engine: Engine) -> None:
    """One coordinator step, then the answer of the flush it sent (released messages go out with it)."""
    engine._step()
    engine._flushes.settle_in_flight()


def hand_out(engine: Engine, count: int) -> None:
    """Partition 0 assigned, records 0..count-1 fetched, and a step: they go out."""
    engine._fetcher._on_assign(engine.consumer, P0)
    engine._handle([engine._fetcher.fetched([record(o) for o in range(count)])], time.monotonic())
    step(engine)


@pytest.fixture
def engine(store: FakeStore) -> Iterator[Engine]:
    engine = make_engine(store)
    yield engine
    engine.consumer.close()


def test_records_fetched_before_a_loss_never_reach_the_next_ownership(engine: Engine) -> None:
    """SUB-3: records fetched before partition 0 was lost, still queued when it is assigned back, are
    dropped; the refetch from the committed offset (50) is taken whole, so the commit point stays at 50.
    Without assignment generations the stale batch (100..109) set the next offset past the refetch,
    50..99 were dropped as duplicates and the watermark jumped to 100: 50 messages lost."""
    engine._fetcher._on_assign(engine.consumer, P0)
    stale = engine._fetcher.fetched([record(o) for o in range(100, 110)])
    engine._fetcher._on_lost(engine.consumer, P0)
    engine.consumer.incremental_unassign(P0)  # what the client does after the callback
    engine._fetcher._on_assign(engine.consumer, P0)
    refetch = engine._fetcher.fetched([record(o) for o in range(50, 110)])
    now = time.monotonic()
    engine._handle([stale], now)
    engine._handle([refetch], now)
    state = engine._partitions[0]
    assert state.epoch == 2
    assert state.watermark == 50
    assert state.buffered == 60


def test_records_fetched_before_a_revoke_are_dropped_when_no_one_owns_the_partition(engine: Engine) -> None:
    """SUB-3: a revoked partition takes no record fetched for its earlier ownership, and the
    ownership after the next assignment takes only its own records."""
    engine._fetcher._on_assign(engine.consumer, P0)
    stale = engine._fetcher.fetched([record(o) for o in range(0, 5)])
    engine._fetcher._on_revoke(engine.consumer, P0)
    engine.consumer.incremental_unassign(P0)
    engine._handle([stale], time.monotonic())
    assert 0 not in engine._partitions
    engine._fetcher._on_assign(engine.consumer, P0)
    engine._handle([stale], time.monotonic())
    engine._handle([engine._fetcher.fetched([record(o) for o in range(3, 8)])], time.monotonic())
    assert engine._partitions[0].watermark == 3
    assert engine._partitions[0].buffered == 5


def not_a_failure(state: OwnedPartition, delivery: Delivery, now: float) -> bool:
    """A nack of ``delivery`` holds its key for the first backoff: no failure was counted before it."""
    assert state.nack(delivery, now, SETTINGS.retry_policy.backoff)
    return state.next_wake() == now + SETTINGS.retry_policy.backoff(1)


def test_a_failed_redis_write_gives_deliveries_back_without_counting_failures(store: FakeStore) -> None:
    """DLQ-1, ACK-6: when Redis does not take the attempt counts, the deliveries go back unseen and
    their keys' failure counts (which lengthen the backoff) do not grow; nor do their attempts."""
    handed: list[Message] = []
    engine = make_engine(store, handed.extend)
    try:
        engine._fetcher._on_assign(engine.consumer, P0)
        engine._handle([engine._fetcher.fetched([record(o) for o in range(3)])], time.monotonic())
        store.failing = True
        step(engine)
        state = engine._partitions[0]
        assert handed == [] and engine._leases.count == 0
        assert state.buffered == 3
        held = state.next_wake()
        assert held is not None and held - time.monotonic() <= REQUEUE_DELAY
        state.core.wake(held)
        again, _ = state.release_ready(held, 3, 1, 10**9, None, pooled=True, leases=engine._leases)
        assert [d.attempt for d in again] == [1, 1, 1]  # the attempts not recorded were taken back
        assert not_a_failure(state, again[0], held)
    finally:
        engine.consumer.close()


def test_a_failed_dead_letter_write_requeues_without_counting_a_failure(store: FakeStore) -> None:
    """DLQ-1, DLQ-2: a dead letter the broker did not take leaves the message unsettled and redelivered
    (after a fixed delay), but its key's failure count does not grow."""
    handed: list[Message] = []
    engine = make_engine(store, handed.extend)
    try:
        engine._fetcher._on_assign(engine.consumer, P0)
        engine._handle([engine._fetcher.fetched([record(0)])], time.monotonic())
        step(engine)
        assert [m.delivery_attempt for m in handed] == [1]
        state = engine._partitions[0]
        [delivery] = handed
        engine._handle([DeadLettered(0, state.epoch, delivery.queue_key, 0, "broker down")], time.monotonic())
        assert engine._leases.count == 0
        assert state.buffered == 1
        held = state.next_wake()
        assert held is not None and held - time.monotonic() <= REQUEUE_DELAY
        state.core.wake(held)
        [again], _ = state.release_ready(held, 1, 1, 10**9, None, pooled=True, leases=engine._leases)
        assert again.attempt == 2
        assert not_a_failure(state, again, held)
    finally:
        engine.consumer.close()


def test_a_recovery_walk_releases_once_it_reaches_the_last_settled_offset_or_the_buffer_limit(
        store: FakeStore) -> None:
    """SUB-4, SUB-7: after a claim nothing is released until the records up to the highest offset
    settled before have been taken (so the unsettling of a cascade's later records is written with
    its first release); a walk the fetch cannot finish, held over the buffer limit, releases anyway."""
    handed: list[Message] = []
    engine = make_engine(store, handed.extend)
    try:
        store.settled = frozenset({5})
        engine._fetcher._on_assign(engine.consumer, P0)
        engine._handle([engine._fetcher.fetched([record(o) for o in range(3)])], time.monotonic())
        step(engine)
        assert handed == [] and engine._partitions[0].core.walking
        engine._handle([engine._fetcher.fetched([record(o) for o in range(3, 6)])], time.monotonic())
        step(engine)
        # Few keys ready: each key's run (0 and 3, 1 and 4, 2 and 5); 5, settled before, cascades behind 2.
        assert [m.offset() for m in handed] == [0, 3, 1, 4, 2, 5]
        assert not engine._partitions[0].core.walking
        store.settled = frozenset({10_000})
        engine._fetcher._on_assign(engine.consumer, [TopicPartition(TOPIC, 1)])
        engine._gate.max_buffered = 4
        engine._handle([engine._fetcher.fetched([record(o, 1) for o in range(5)])], time.monotonic())
        step(engine)
        assert [m.offset() for m in handed if m.partition() == 1] == []
        step(engine)  # the step before saw the fetch held over the buffer limit and ended the walk
        assert [m.offset() for m in handed if m.partition() == 1] == [0, 3, 1, 4, 2]  # runs: few keys
    finally:
        engine.consumer.close()


def test_a_walk_ended_at_the_buffer_limit_marks_its_cascades_and_holds_the_commit(store: FakeStore) -> None:
    """SUB-4 across a crash: a walk ended early writes each cascading key's mark before the key's first
    release, and the commit point stays at the lowest mark, so that a successor finds the marked
    records and the marks in its claim; its claim's marks cascade their keys again, settled records
    included, and are dropped once its walk has ended."""
    handed: list[Message] = []
    engine = make_engine(store, handed.extend)
    try:
        store.settled = frozenset({10_000})
        engine._fetcher._on_assign(engine.consumer, P0)
        engine._gate.max_buffered = 4
        engine._handle([engine._fetcher.fetched([record(o) for o in range(5)])], time.monotonic())
        step(engine)
        step(engine)  # the walk ends at the buffer limit
        assert [m.offset() for m in handed] == [0, 3, 1, 4, 2]  # few keys ready: each key's run
        released = {OpKind.RELEASED, OpKind.BATCH_RELEASED, OpKind.FIRST_RELEASED, OpKind.BATCH_FIRST_RELEASED}
        kinds = [("r" if op[0] in released else op[0], op[1]) for _, op in store.op_log
                 if op[0] == OpKind.CASCADE_FROM or op[0] in released]
        assert kinds == [("c", 0), ("c", 1), ("c", 2), ("r", 0), ("r", 3), ("r", 1), ("r", 4), ("r", 2)]
        for message in handed:
            message.ack()
        step(engine)
        assert engine._partitions[0].watermark == 0  # not 3: held at the lowest mark
    finally:
        engine.consumer.close()
    # A successor after a crash: 0-2 were acked, 4 (key-1) was settled by an owner before them.
    handed.clear()
    store.op_log.clear()
    store.settled, store.cascades = frozenset({0, 1, 2, 4}), frozenset({0, 1, 2})
    successor = make_engine(store, handed.extend)
    try:
        successor._fetcher._on_assign(successor.consumer, P0)
        successor._handle([successor._fetcher.fetched([record(o) for o in range(5)])], time.monotonic())
        step(successor)
        # Settled, but their keys cascade from the marks (each key's run: 0 and 3, 1 and 4, 2).
        assert [m.offset() for m in handed] == [0, 3, 1, 4, 2]
        assert [(op[0], op[1]) for _, op in store.op_log if op[0] in "ux"] == [
            ("u", 0), ("u", 1), ("u", 2), ("u", 4), ("x", 0), ("x", 1), ("x", 2)]
    finally:
        successor.consumer.close()


def test_metrics_snapshot_counts_deliveries_settlements_and_drains_observations(store: FakeStore) -> None:
    """ACK-1, SUB-7: the metrics hook: counters, gauges, per-partition gauges, drained observation lists."""
    handed: list[Message] = []
    engine = make_engine(store, handed.extend)
    try:
        hand_out(engine, 3)
        assert len(handed) == 3
        handed[0].ack()
        handed[1].nack()
        step(engine)
        snapshot = engine.metrics_snapshot()
        assert {k: snapshot[k] for k in ("delivered", "acked", "nacked", "redelivered", "dead_lettered",
                                          "lease_extensions", "lease_lapses", "malformed_records",
                                          "outstanding", "held_keys")} == {
            "delivered": 3, "acked": 1, "nacked": 1, "redelivered": 0, "dead_lettered": 0,
            "lease_extensions": 0, "lease_lapses": 0, "malformed_records": 0, "outstanding": 1, "held_keys": 2}
        partition = snapshot["partitions"][0]
        assert (partition["outstanding"], partition["buffered"], partition["held_keys"]) == (1, 1, 2)
        assert 0.0 <= partition["oldest_unacked_seconds"] < 60
        assert len(snapshot["ack_latency_seconds"]) == 1
        assert len(snapshot["redis_flush_seconds"]) >= 1
        again = engine.metrics_snapshot()
        assert again["ack_latency_seconds"] == [] and again["redis_flush_seconds"] == []
        assert again["acked"] == 1
    finally:
        engine.consumer.close()


class CountingConsumer:
    """Stands in for the fetch thread's consumer: counts ``consume`` calls, returns nothing."""

    def __init__(self) -> None:
        self.consumed = 0

    def consume(self, num_messages: int, timeout: float) -> list[object]:
        self.consumed += 1
        return []

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        """Commits queued by the coordinator's steps: nothing to do here."""


def test_the_fetch_takes_no_records_while_its_posted_batches_wait(engine: Engine) -> None:
    """SUB-7: a fetched batch counts as in flight from its post until the coordinator takes it; while
    ``max_in_flight`` records are in flight the fetch thread does not consume."""
    engine._fetcher._on_assign(engine.consumer, P0)
    real = engine._fetcher.consumer
    counting = CountingConsumer()
    engine._fetcher.consumer = cast(Consumer, counting)
    try:
        gate = engine._gate
        batch = engine._fetcher.fetched([record(offset) for offset in range(gate.max_in_flight)])
        gate.posted(len(batch.records))
        engine._fetcher.step()
        assert counting.consumed == 0
        engine._handle([batch], time.monotonic())
        assert gate.in_flight == 0
        engine._fetcher.step()
        assert counting.consumed == 1
        assert engine.stats()["buffered"] == gate.max_in_flight
    finally:
        engine._fetcher.consumer = real


class CountingNativeFetch:
    """Stands in for the native fetch: counts ``fetch`` calls, returns nothing."""

    def __init__(self) -> None:
        self.fetches = 0

    def fetch(self, max_messages: int, timeout: float,
              caps: dict[int, int] | None = None) -> tuple[list[Record], list[tuple[int, int, str]]]:
        self.fetches += 1
        return [], []


def test_the_fetch_takes_no_records_while_enough_keys_are_ready(engine: Engine) -> None:
    """SUB-7: once ``max_ready`` keys are ready (nothing released: no pull waits) the fetch thread
    serves the consumer's events but takes no records; when a pull's release leaves fewer than
    ``resume_fraction`` of them, it takes records again."""
    engine._fetcher._on_assign(engine.consumer, P0)
    gate = engine._gate
    keys = gate.max_ready
    batch = engine._fetcher.fetched([record(offset, keys=keys) for offset in range(keys)])
    gate.posted(len(batch.records))
    engine._handle([batch], time.monotonic())
    step(engine)
    assert engine._owned.ready() == keys and gate.ample
    real_consumer, real_native = engine._fetcher.consumer, engine._fetcher.native
    counting, native = CountingConsumer(), CountingNativeFetch()
    engine._fetcher.consumer, engine._fetcher.native = cast(Consumer, counting), cast(NativeFetch, native)
    try:
        engine._fetcher.step()
        assert (counting.consumed, native.fetches) == (1, 0)
        pull = Pull(keys // 2, time.monotonic() + 60, Future())
        engine._handle([pull], time.monotonic())
        step(engine)
        assert len(pull.future.result(0)) == keys // 2
        assert not gate.ample
        engine._fetcher.step()
        assert (counting.consumed, native.fetches) == (2, 1)
    finally:
        engine._fetcher.consumer, engine._fetcher.native = real_consumer, real_native


class PausingConsumer(CountingConsumer):
    """``CountingConsumer`` that records ``pause`` and ``resume`` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.pauses: list[tuple[str, list[int]]] = []

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.pauses.append(("pause", [tp.partition for tp in partitions]))

    def resume(self, partitions: list[TopicPartition]) -> None:
        self.pauses.append(("resume", [tp.partition for tp in partitions]))


class CapsNativeFetch(CountingNativeFetch):
    """``CountingNativeFetch`` that records the caps of each fetch."""

    def __init__(self) -> None:
        super().__init__()
        self.caps: list[dict[int, int] | None] = []

    def fetch(self, max_messages: int, timeout: float,
              caps: dict[int, int] | None = None) -> tuple[list[Record], list[tuple[int, int, str]]]:
        self.caps.append(None if caps is None else dict(caps))
        return super().fetch(max_messages, timeout, caps)


def test_the_native_fetch_holds_a_paused_gate_without_pausing_the_consumer(engine: Engine) -> None:
    """SUB-7: with the native fetch a PAUSED gate takes no records but the short partitions' share,
    and the consumer is never paused or resumed (librdkafka's pause() waits for a broker thread with
    the GIL held, and throws the prefetch away): its events are still served at every turn, and the
    gate's opening takes from every partition again."""
    engine._fetcher._on_assign(engine.consumer, P0)
    gate = engine._gate
    gate.update(0, 0, gate.buffer_limit(), 0.0)  # over the buffer limit since t = 0: PAUSED from now on
    assert gate.fetch_state(time.monotonic()) is Gate.PAUSED and engine.stats()["fetch_paused"] == 1
    real_consumer, real_native = engine._fetcher.consumer, engine._fetcher.native
    consumer, native = PausingConsumer(), CapsNativeFetch()
    engine._fetcher.consumer, engine._fetcher.native = cast(Consumer, consumer), cast(NativeFetch, native)
    try:
        gate.short = {}
        engine._fetcher.step()
        assert (consumer.consumed, native.caps) == (1, [])
        gate.short = {0: 100}
        engine._fetcher.step()
        assert (consumer.consumed, native.caps) == (2, [{0: 100}])
        gate.short = {}
        gate.update(0, 0, 0, time.monotonic())
        assert gate.state is Gate.OPEN
        engine._fetcher.step()
        assert (consumer.consumed, native.caps) == (3, [{0: 100}, None])
        assert consumer.pauses == []
    finally:
        engine._fetcher.consumer, engine._fetcher.native = real_consumer, real_native


def test_a_pull_is_answered_on_its_own_thread_from_the_messages_released_ahead(store: FakeStore) -> None:
    """GRP-5, SUB-1: between the coordinator's steps a pull is taken on the pulling thread; the messages
    released ahead answer it at once, with no step of the coordinator (whose thread is not running
    here), and the next step releases ahead of the next pull."""
    engine = make_engine(store)
    try:
        engine._fetcher._on_assign(engine.consumer, P0)
        records = [record(offset, keys=20) for offset in range(20)]
        engine._handle([engine._fetcher.fetched(records)], time.monotonic())
        answers: list[list[Message]] = []

        def pull() -> None:
            answers.append(engine.pull(5, 30.0))

        first = threading.Thread(target=pull, daemon=True)
        first.start()
        wait_until(lambda: engine._pulls.wanted() == (5, True), 10, "the first pull waiting")
        step(engine)  # released for the waiting pull
        first.join(10)
        step(engine)  # released ahead of the next pull
        assert [m.offset() for m in answers[0]] == [0, 1, 2, 3, 4]
        second = threading.Thread(target=pull, daemon=True)
        second.start()
        second.join(10)
        assert not second.is_alive(), "the pull waited for a coordinator step"
        assert [m.offset() for m in answers[1]] == [5, 6, 7, 8, 9]
        step(engine)
        # Released ahead: every record left (AHEAD_AT_LEAST at most), 10 of them still ready.
        assert engine._pulls.wanted() == (AHEAD_AT_LEAST - 10, False)
    finally:
        engine.consumer.close()


def test_a_pull_that_cannot_get_the_lock_in_its_timeout_goes_through_the_inbox(store: FakeStore) -> None:
    """GRP-5: a pull whose timeout passes while another thread holds the engine's lock is posted to the
    inbox; the coordinator's next step answers it (empty: its deadline passed)."""
    engine = make_engine(store)
    try:
        answers: list[list[Message]] = []
        with engine._lock:
            puller = threading.Thread(target=lambda: answers.append(engine.pull(5, 0.05)), daemon=True)
            puller.start()
            wait_until(lambda: len(engine._inbox) == 1, 10, "the pull in the inbox")
        step(engine)
        puller.join(10)
        assert answers == [[]]
    finally:
        engine.consumer.close()


def test_ack_all_posts_one_list_per_engine_which_settles_it_as_a_run_of_acks(store: FakeStore) -> None:
    """GRP-5, ACK-4: ``Subscriber.acknowledge`` (``ack_all``) marks each message settled, puts the
    first acks of released messages in their engine's ack queue, and posts the other messages of one
    engine to its inbox as one list; the coordinator settles them as it settles plain acks one by one
    (SETTLED ops, the commit point past them)."""
    handed: list[Message] = []
    engine = make_engine(store, handed.extend)
    try:
        hand_out(engine, 3)
        assert [m.offset() for m in handed] == [0, 1, 2]
        elsewhere: list[object] = []
        foreign = Message(record(7), b"key-1", 1, 1, TOPIC, 1, elsewhere.append)
        ack_all([*handed, foreign])
        assert all(m.settled for m in handed) and foreign.settled
        assert len(engine._acks) == 3 and len(engine._inbox) == 0 and elsewhere == [[foreign]]
        step(engine)
        assert engine._partitions[0].watermark == 3 and engine._counts["acked"] == 3
        engine._flushes.flush()
        assert sorted(op[1] for _, op in store.op_log if op[0] == OpKind.SETTLED) == [0, 1, 2]
    finally:
        engine.consumer.close()


def settled_offsets(store: FakeStore) -> list[int]:
    return sorted(op[1] for _, op in store.op_log if op[0] == OpKind.SETTLED)


def test_a_plain_ack_goes_to_the_ack_queue_and_is_settled_once(store: FakeStore) -> None:
    """ACK-4, ACK-5: a released message's first plain ack is its lease handle in the engine's ack
    queue (the inbox is not written); acking it again goes through the inbox and changes nothing."""
    handed: list[Message] = []
    engine = make_engine(store, handed.extend)
    try:
        hand_out(engine, 3)
        handed[0].ack()
        assert list(engine._acks.take()) == [handed[0].lease] and len(engine._inbox) == 0
        engine._acks.post(handed[0].lease)  # as it was
        handed[0].ack()
        assert len(engine._acks) == 1 and len(engine._inbox) == 1
        step(engine)
        engine._flushes.flush()
        assert engine._counts["acked"] == 1 and engine._partitions[0].watermark == 1
        assert settled_offsets(store) == [0] and handed[0].settled is True
    finally:
        engine.consumer.close()


def test_a_request_after_a_queued_ack_is_applied_after_it(store: FakeStore) -> None:
    """SUB-4, ACK-5: an ack queued is its message's first request; a nack of the same message after
    it goes through the inbox, and the step applies the queue first, so the ack stands (the nack
    finds nothing outstanding). Nacked first, a message's later ack follows the nack through the
    inbox: the nack stands. A nack marks a message NACKED whatever came before it (``Message.settled``)."""
    handed: list[Message] = []
    engine = make_engine(store, handed.extend)
    try:
        hand_out(engine, 2)
        acked, nacked = handed
        assert acked.queue_key != nacked.queue_key
        acked.ack()
        acked.nack()
        nacked.nack()
        nacked.ack()
        assert len(engine._acks) == 1 and len(engine._inbox) == 3
        step(engine)
        engine._flushes.flush()
        assert (engine._counts["acked"], engine._counts["nacked"]) == (1, 1)
        assert settled_offsets(store) == [0] and acked.settled == nacked.settled == NACKED  # as ``_send`` marks
    finally:
        engine.consumer.close()


def test_acks_made_while_the_step_hands_out_are_settled_before_its_release(store: FakeStore) -> None:
    """ACK-4: the acks user code makes right after a step handed messages out (the workers get the
    interpreter lock then) are settled in the same step, so its release already sends the keys'
    next records: the ack -> next delivery cycle of a key takes one step, not two."""
    handed: list[Message] = []

    def acking(messages: list[Message]) -> None:  # a worker that ran each callback at once
        handed.extend(messages)
        for message in messages:
            message.ack()

    keys = 600  # enough that each key releases one record at a time (no runs)
    engine = make_engine(store, acking)
    try:
        engine._fetcher._on_assign(engine.consumer, P0)
        fetched = [record(o, keys=keys) for o in range(3 * keys)]
        engine._handle([engine._fetcher.fetched(fetched)], time.monotonic())
        engine._step()  # the first record of each key goes out
        engine._flushes.settle_in_flight()
        assert len(handed) == keys and engine._counts["acked"] == 0
        engine._step()  # their acks are settled, the second records released; their flush goes to Redis
        assert engine._flushes.in_flight == 1 and engine._counts["acked"] == keys
        flights = engine._flushes._flights
        wait_until(lambda: all(done is None or done.done() for _, _, done in flights), 10, "the flush answered")
        engine._step()  # the answer hands the second records out; their acks free the keys at once
        assert [m.record.offset for m in handed] == list(range(2 * keys))
        assert engine._counts["acked"] == 2 * keys and engine._leases.count == keys  # the third ones are out
        engine._flushes.settle_in_flight()
        assert [m.record.offset for m in handed] == list(range(3 * keys))
    finally:
        engine.consumer.close()


def test_the_first_ack_after_the_engine_armed_its_queue_wakes_it_once() -> None:
    """The engine arms its ack queue before it sleeps: the first post calls the waker (the inbox's
    nudge), the posts after it do not; with acks waiting, arming refuses (the engine must not sleep);
    a disarmed queue wakes no one."""
    woken: list[None] = []
    queue = AckQueue(lambda: woken.append(None))
    assert queue.arm()
    queue.post(5)
    queue.post(6)
    assert len(woken) == 1 and not queue.arm() and queue.take() == [5, 6] and len(queue) == 0
    assert queue.arm()
    queue.disarm()
    queue.post(7)
    assert len(woken) == 1 and queue.take() == [7]


def test_a_sleeping_engine_is_woken_by_a_queued_ack(store: FakeStore) -> None:
    """The coordinator's wait ends when an ack is queued (no timer could end it here)."""
    handed: list[Message] = []
    engine = make_engine(store, handed.extend)
    stop = threading.Event()
    try:
        hand_out(engine, 1)

        def coordinator() -> None:
            while engine._counts["acked"] == 0 and not stop.is_set():
                engine._step()

        engine._wait_time = lambda now: 3600.0  # type: ignore[method-assign]
        waiting = threading.Thread(target=coordinator, daemon=True)
        waiting.start()
        wait_until(lambda: engine._inbox._wake_at == 1, 5, "the coordinator to sleep")
        handed[0].ack()
        wait_until(lambda: engine._counts["acked"] == 1, 5, "the ack to be settled")
        waiting.join(5)
    finally:
        stop.set()
        engine._inbox.nudge()
        engine.consumer.close()


def test_messages_no_engine_queues_for_ack_through_their_submit(store: FakeStore) -> None:
    """A message made outside a release (no ack queue), or whose ``_submit`` was replaced (tracing),
    hands every request, plain acks included, to ``_submit``; one made with no ``_submit`` refuses."""
    handed: list[Message] = []
    engine = make_engine(store, handed.extend)
    try:
        hand_out(engine, 1)
        traced: list[object] = []
        handed[0]._submit = traced.append
        handed[0].ack()
        assert traced == [handed[0]] and len(engine._acks) == 0
        elsewhere: list[object] = []
        made = Message(record(7), b"key-1", 1, 1, TOPIC, 1, elsewhere.append, lease=3)
        made.ack()
        assert elsewhere == [made] and made.settled is True
        with pytest.raises(RuntimeError):
            Message(record(8), b"key-2", 1, 1, TOPIC, 1).ack()
        with pytest.raises(RuntimeError):
            ack_all([Message(record(9), b"key-0", 1, 1, TOPIC, 1)])
    finally:
        engine.consumer.close()


def test_threads_reading_and_acking_the_same_messages_at_once() -> None:
    """Messages are read and settled by several threads at once (workers, user code, the engine):
    four threads ack every released message, in different orders, while another reads their fields
    and a third settles the queue as the coordinator would. No call fails, each message's first ack
    alone is queued (the others go to the inbox), and every delivery is settled exactly once."""
    leases = LeaseTable(ack_deadline=10.0, max_lease_duration=60.0, min_extension=10.0, max_extension=600.0)
    inbox: list[object] = []
    queue = AckQueue(lambda: None)
    owned = {0: OwnedPartition(0, 1, ordered=False, submit=inbox.append, acks=queue)}
    count = 4000
    owned[0].add([record(offset, keys=count) for offset in range(count)])
    messages, _ = owned[0].release_ready(0.0, count, 1, 10**9, None, pooled=True, leases=leases)
    assert len(messages) == count
    failures: list[BaseException] = []
    settled = [0]
    done = threading.Event()

    def guarded(work: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                failures.append(exc)
        return run

    def acker(order: int) -> Callable[[], None]:
        turned = messages[order * count // 4:] + messages[:order * count // 4]
        ordered = turned if order % 2 else list(reversed(turned))
        def ack_each() -> None:
            for message in ordered:
                message.ack()
        return guarded(ack_each)

    def reader() -> None:
        while not done.is_set():
            for message in messages:
                _ = (message.record.offset, message.lease, message.settled, message._submit, message.queue_key,
                     message.attempt, message.token, message._epoch)

    def coordinator() -> None:
        while not done.is_set():
            settled[0] += leases.ack_queued(queue, owned, 0.0)

    threads = [threading.Thread(target=guarded(work)) for work in (reader, coordinator)]
    ackers = [threading.Thread(target=acker(order)) for order in range(4)]
    for thread in threads + ackers:
        thread.start()
    for thread in ackers:
        thread.join(60)
    done.set()
    for thread in threads:
        thread.join(60)
    settled[0] += leases.ack_queued(queue, owned, 0.0)
    assert not failures
    assert settled[0] == count and leases.count == 0 and all(m.settled is True for m in messages)
    assert len(inbox) == 3 * count and leases.ack_run(inbox, owned, 0.0) == 0


def test_ack_all_queues_runs_of_first_acks_in_order_and_hands_back_the_rest() -> None:
    """``ack_all``'s compiled pass (``ack_queued_all``): the first plain acks of released messages go
    to their engines' ack queues in order, a run to one queue in one post (each armed queue woken
    once); a message acked before, or made outside a release, comes back for its ``_submit``, in
    order; every message is marked settled. ``unsettled`` keeps those with no ack or nack."""
    woken: list[str] = []

    def waker(name: str) -> Callable[[], None]:
        return lambda: woken.append(name)

    queues = {name: AckQueue(waker(name)) for name in "ab"}
    leases = LeaseTable(ack_deadline=10.0, max_lease_duration=60.0, min_extension=10.0, max_extension=600.0)
    released = {}
    for number, name in enumerate("ab"):
        state = OwnedPartition(number, 1, ordered=False, submit=lambda event: None, acks=queues[name])
        state.add([record(offset, number, keys=10) for offset in range(4)])
        released[name], _ = state.release_ready(0.0, 4, 1, 10**9, None, pooled=True, leases=leases)
    a, b = released["a"], released["b"]
    a[0].ack()
    made = Message(record(9), b"key-9", 1, 1, TOPIC, 1, lambda event: None)
    assert queues["a"].take() == [a[0].lease]
    for queue in queues.values():
        assert queue.arm()
    b[3].nack()
    assert unsettled([*a, *b]) == [*a[1:], *b[:3]]
    rest = ack_queued_all([a[1], a[2], b[0], b[1], a[0], made, a[3], b[2]])
    assert rest == [a[0], made]
    assert queues["a"].take() == [a[1].lease, a[2].lease, a[3].lease]
    assert queues["b"].take() == [b[0].lease, b[1].lease, b[2].lease]
    assert sorted(woken) == ["a", "b"]
    assert unsettled([*a, *b, made]) == [] and b[3].settled == NACKED
