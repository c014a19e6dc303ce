"""Batched state ops alone: due times, one round trip per flush, answers to ack futures (ACK-4, ACK-5)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import cast, get_args

import pytest
import redis

from ordering_layer._core import OP_LETTERS, evalsha_commands
from ordering_layer.state import ApplyResult, StateStore
from ordering_layer.state.store import Op, OpKind, OpLetter, unpack_ops
from ordering_layer.subscriber.message import AckResponse
from ordering_layer.subscriber.state_writer import StateWriter


class FakeStore:
    def __init__(self, results: dict[int, ApplyResult]) -> None:
        self.results = results
        self.calls: list[list[tuple[int, int, list[Op]]]] = []
        self.failing = False

    def apply_many(self, batches: Sequence[tuple[str, int, int, Sequence[Op]]]) -> list[ApplyResult]:
        if self.failing:
            raise redis.ConnectionError("down")
        self.calls.append([(p, e, list(ops)) for _, p, e, ops in batches])
        return [self.results.get(p, ApplyResult.APPLIED) for _, p, _, _ in batches]

    def apply_packed(self, batches: Sequence[tuple[str, int, int, str]]) -> list[ApplyResult]:
        return self.apply_many([(s, p, e, unpack_ops(packed)) for s, p, e, packed in batches])


class Ops:
    """A partition's op queue (``OwnedPartition``'s side of ``PartitionOps``)."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.packed = ""

    def push_op(self, kind: OpLetter, offset: int, value: int) -> None:
        self.packed += f"{kind},{offset},{value};"

    def take_ops(self, *, floor: bool = False) -> str:
        packed, self.packed = self.packed, ""
        return packed


def test_a_flush_is_due_by_size_or_age_and_writes_all_partitions_in_one_call() -> None:
    """ACK-4: ops are batched, flushed at a size cap or an age cap, all partitions in one round trip."""
    store = FakeStore({})
    writer = StateWriter(cast(StateStore, store), "sub", max_ops=3, max_age=0.005)
    owned = {0: Ops(7), 1: Ops(8)}
    writer.push(owned[0], OpKind.SETTLED, 1, 0, now=10.0)
    assert not writer.due(10.001) and writer.due(10.006)
    assert writer.next_due() == 10.005
    owned[1].push_op(OpKind.SETTLED, 2, 0)  # queued by the partition's core, counted by the coordinator
    owned[1].push_op(OpKind.NACKED, 3, 0)
    writer.queued(2, now=10.001)
    assert writer.due(10.001)
    assert writer.flush(owned) == {0: ApplyResult.APPLIED, 1: ApplyResult.APPLIED}
    assert store.calls == [[(0, 7, [("a", 1, 0)]), (1, 8, [("a", 2, 0), ("n", 3, 0)])]]
    assert writer.count == 0 and writer.next_due() is None
    assert len(writer.flush_seconds) == 1


def test_futures_learn_success_fencing_or_lost_ownership() -> None:
    """ACK-5: ack_with_response is SUCCESS once written, LEASE_LOST when fenced or no longer owned."""
    store = FakeStore({1: ApplyResult.FENCED})
    writer = StateWriter(cast(StateStore, store), "sub")
    futures: list[Future[AckResponse]] = [Future(), Future(), Future()]
    owned = {0: Ops(1), 1: Ops(1), 2: Ops(1)}
    for partition, future in enumerate(futures):
        writer.push(owned[partition], OpKind.SETTLED, 5, 0, now=0.0)
        writer.add_future(partition, future)
    del owned[2]  # partition 2 is not owned any more
    results = writer.flush(owned)
    assert results == {0: ApplyResult.APPLIED, 1: ApplyResult.FENCED}
    assert [f.result() for f in futures] == [AckResponse.SUCCESS, AckResponse.LEASE_LOST, AckResponse.LEASE_LOST]


def test_a_failed_write_keeps_the_ops_for_the_next_flush() -> None:
    """SUB-3: a Redis failure loses no state change: the ops wait for the next flush, before the
    ops queued after it; a partition let go meanwhile takes them with it."""
    store = FakeStore({})
    writer = StateWriter(cast(StateStore, store), "sub")
    owned = {0: Ops(1), 1: Ops(1)}
    writer.push(owned[0], OpKind.SETTLED, 5, 0, now=0.0)
    writer.push(owned[1], OpKind.SETTLED, 9, 0, now=0.0)
    store.failing = True
    assert writer.flush(owned) is None
    assert writer.count == 2
    store.failing = False
    writer.push(owned[0], OpKind.NACKED, 6, 0, now=0.1)
    writer.drop(1)
    assert writer.flush(owned) == {0: ApplyResult.APPLIED}
    assert store.calls == [[(0, 1, [("a", 5, 0), ("n", 6, 0)])]]


def test_the_cores_encoding_of_a_flush_is_redis_pys() -> None:
    """ACK-4: a pipelined flush's ``apply.lua`` calls, encoded by the core for the socket, are the
    bytes redis-py's ``pack_commands`` makes of the same EVALSHA calls; malformed ops are refused
    before anything is encoded."""
    batches = [("sub", 0, 3, "b,0,1700000000000;q,5,1;q,6,2;a,4,1;a,3,0;f,0,5;"), ("sub", 11, 1, "n,9,2;u,8,0;c,7,0;")]
    sha = "e" * 40
    commands = [("EVALSHA", sha, len(keys), *keys, *args) for keys, args in StateStore.apply_calls(batches)]
    expected = b"".join(redis.Connection().pack_commands(commands))
    assert evalsha_commands(sha, StateStore.apply_packed_calls(batches)) == expected
    with pytest.raises(ValueError):
        evalsha_commands(sha, [(["k"], 1, "z,1,1;")])


def test_the_op_alphabet_is_the_cores() -> None:
    """``OpKind`` reads each op's letter from the core (``core/src/ops.rs``); the ``OpLetter`` type
    names exactly those letters, once each."""
    names = [name for name in vars(OpKind) if name.isupper()]
    assert {name: getattr(OpKind, name) for name in names} == OP_LETTERS
    assert sorted(get_args(OpLetter)) == sorted(OP_LETTERS.values())
    assert len(set(OP_LETTERS.values())) == len(OP_LETTERS)
