"""The Redis state store's fence against real Redis: epochs across a loss of Redis state (ACK-5, SUB-3)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import redis

from ordering_layer.state import ApplyResult, StateStore
from ordering_layer.state.pipe import ApplyPipe
from ordering_layer.state.store import Op, OpKind, cascades_key, firsts_key, partition_keys, seek_key
from tests.checker import wait_until

pytestmark = pytest.mark.integration


def test_after_a_loss_of_redis_state_only_the_latest_owner_writes(endpoints: Any,
                                                                  unique_name: Callable[[str], str]) -> None:
    """ACK-5, SUB-3: a zombie (an earlier owner that lives on) and the current owner keep writing after
    Redis lost the partition's keys. Whoever writes first, the zombie is fenced from the owner's
    next write on, for good, and the owner is never fenced (before, the first writer's epoch was
    adopted and the other one was fenced: the zombie could fence the real owner out)."""
    store = StateStore(endpoints.redis_url)
    name = unique_name("fence")
    ops: list[Op] = [(OpKind.DELIVERED, 7, 1)]
    zombie = store.claim(name, 0).epoch
    owner = store.claim(name, 0).epoch
    assert owner > zombie
    assert store.apply_many([(name, 0, zombie, ops)]) == [ApplyResult.FENCED]

    store.client.delete(*partition_keys(name, 0))  # Redis lost the partition's state
    assert store.apply_many([(name, 0, zombie, ops)]) == [ApplyResult.ADOPTED]  # the zombie writes first
    assert store.apply_many([(name, 0, owner, ops)]) == [ApplyResult.ADOPTED]
    for _ in range(3):
        assert store.apply_many([(name, 0, zombie, ops)]) == [ApplyResult.FENCED]
        assert store.apply_many([(name, 0, owner, ops)]) == [ApplyResult.APPLIED]

    store.client.delete(*partition_keys(name, 0))  # the owner writes first this time
    assert store.apply_many([(name, 0, owner, ops)]) == [ApplyResult.ADOPTED]
    assert store.apply_many([(name, 0, zombie, ops)]) == [ApplyResult.FENCED]


def test_a_claim_after_a_loss_of_redis_state_fences_every_earlier_owner(endpoints: Any,
                                                                        unique_name: Callable[[str], str]) -> None:
    """ACK-5: a claim made after Redis lost the epoch key still hands out an epoch above every one
    handed out before, so earlier owners stay fenced whatever order they write in."""
    store = StateStore(endpoints.redis_url)
    name = unique_name("reclaim")
    earlier = [store.claim(name, 0).epoch for _ in range(3)]
    store.client.delete(*partition_keys(name, 0))
    latest = store.claim(name, 0).epoch
    assert latest > max(earlier)
    ops: list[Op] = [(OpKind.SETTLED, 3, 0)]
    for epoch in earlier:
        assert store.apply_many([(name, 0, epoch, ops)]) == [ApplyResult.FENCED]
    assert store.apply_many([(name, 0, latest, ops)]) == [ApplyResult.APPLIED]


def test_a_pending_seek_is_applied_by_a_claim_or_by_its_owner_and_fences_earlier_writes(
        endpoints: Any, unique_name: Callable[[str], str]) -> None:
    """GRP-3, ACK-5, ACK-6: a recorded seek is pending until applied; a claim, or a re-claim by the
    owner of the current epoch, applies it atomically (settled set replaced, attempts, leases and
    cascade marks dropped, a new epoch that fences the writes of before); a stale epoch cannot re-claim; a later
    seek wins over an earlier one still being recorded; 'applied' is marked by the owner only."""
    store = StateStore(endpoints.redis_url)
    name = unique_name("seek")
    owner = store.claim(name, 0).epoch
    store.apply_many([(name, 0, owner, [(OpKind.SETTLED, 5, 0), (OpKind.DELIVERED, 6, 3), (OpKind.LEASE, 6, 99),
                                        (OpKind.CASCADE_FROM, 3, 0), (OpKind.FIRST_DELIVERED, 8, 1)])])
    assert store.claim_for_seek(name, {0: owner}) == {}  # nothing pending: nothing changes

    generation = store.post_seek(name, {0: (4, (4, 7)), 1: (0, ())})
    assert store.seek_announced(name) == generation
    assert store.seek_status(name, [0, 1])[0].pending
    assert store.claim_for_seek(name, {0: owner - 1}) == {0: None}  # a stale owner is fenced
    [(partition, claimed)] = store.claim_for_seek(name, {0: owner}).items()
    assert partition == 0 and claimed is not None
    assert (claimed.settled, claimed.attempts, claimed.seek_offset, claimed.seek_generation, claimed.cascades) == (
        frozenset({4, 7}), {}, 4, generation, frozenset())
    assert claimed.epoch > owner
    assert store.client.hlen(partition_keys(name, 0)[3]) == 0  # leases dropped
    assert not store.client.exists(firsts_key(name, 0))  # and first attempts
    assert store.apply_many([(name, 0, owner, [(OpKind.SETTLED, 9, 0)])]) == [ApplyResult.FENCED]

    assert store.seek_status(name, [0])[0].pending  # until the owner has committed the target
    assert not store.seek_applied(name, 0, owner, generation)  # a fenced owner marks nothing
    assert store.seek_applied(name, 0, claimed.epoch, generation)
    assert not store.seek_status(name, [0])[0].pending
    assert store.claim(name, 0).seek_offset is None  # applied: a later claim starts at the commit

    # Partition 1 was never claimed: a new owner applies the seek with its claim.
    fresh = store.claim(name, 1)
    assert (fresh.seek_offset, fresh.seek_generation) == (0, generation)

    later = store.post_seek(name, {0: (10, ())})
    # A seek recorded late (an earlier generation) does not overwrite a later one.
    assert store._eval_many("seek_post", [([seek_key(name, 0)], [generation, 1, ""])]) == [0]
    claimed_later = store.claim(name, 0)
    assert (claimed_later.seek_offset, claimed_later.seek_generation) == (10, later)
    assert store.claim_for_seek(name, {1: fresh.epoch}, generation=later) == {}  # p1 has no seek `later`
    store.apply_many([(name, 0, claimed_later.epoch, [(OpKind.CASCADE_FROM, 12, 0)])])
    assert store.seek_applied(name, 0, claimed_later.epoch, later)
    assert store.claim(name, 0).cascades == {12}  # marks outlive a claim that applies no seek
    store.delete_subscription(name)
    assert not store.client.exists(seek_key(name, 0), f"ol:sub:{name}:seek", f"ol:sub:{name}:seek-counter",
                                   cascades_key(name, 0), firsts_key(name, 0))


def test_each_state_op_writes_its_keys_in_the_order_queued(endpoints: Any, unique_name: Callable[[str], str]) -> None:
    """ACK-4, ACK-6, SUB-4: every kind of state op, as ``apply.lua`` applies its command runs: attempts
    (pooled ones negative), batch leases, settles, nacks with and without an attempt, unsettles and
    cascade marks undone in the order queued, and the floor: kept as the member ``_`` (raised, never
    lowered), the settled set trimmed below it, a settle below it adding nothing; a claim reads it."""
    store = StateStore(endpoints.redis_url)
    name = unique_name("ops")
    owner = store.claim(name, 0).epoch
    ops: list[Op] = [
        (OpKind.BATCH_LEASE, 0, 1000), (OpKind.BATCH_RELEASED, 1, 1), (OpKind.BATCH_RELEASED, 2, 1),
        (OpKind.BATCH_DELIVERED, 3, 2), (OpKind.STARTED, 1, 1), (OpKind.SETTLED, 1, 0), (OpKind.NACKED, 2, 0),
        (OpKind.NACKED, 3, 2), (OpKind.DELIVERED, 4, 1), (OpKind.LEASE, 4, 2000), (OpKind.RELEASED, 5, 3),
        (OpKind.SETTLED, 6, 0), (OpKind.UNSETTLED, 6, 0), (OpKind.SETTLED, 7, 0), (OpKind.CASCADE_FROM, 8, 0),
        (OpKind.CASCADE_FROM, 9, 0), (OpKind.CASCADE_DONE, 8, 0), (OpKind.SETTLED, 0, 0), (OpKind.FLOOR, 0, 1),
        (OpKind.SETTLED, 10, 0)]
    assert store.apply_many([(name, 0, owner, ops)]) == [ApplyResult.APPLIED]
    _, settled, attempts, leases = partition_keys(name, 0)
    client = store.client
    assert client.zrange(settled, 0, -1, withscores=True) == [(b"1", 1), (b"_", 1), (b"7", 7), (b"10", 10)]
    assert client.hgetall(attempts) == {b"_": b"0", b"2": b"-1", b"3": b"2", b"4": b"1", b"5": b"-3"}
    assert client.hgetall(leases) == {b"_": b"0", b"4": b"2000"}
    assert client.smembers(cascades_key(name, 0)) == {b"9"}
    # A later floor covers the settles below it; a lower one (a batch applied again) lowers nothing.
    assert store.apply_many([(name, 0, owner, [(OpKind.SETTLED, 8, 0), (OpKind.SETTLED, 12, 0),
                                               (OpKind.FLOOR, 0, 9)])]) == [ApplyResult.APPLIED]
    assert store.apply_many([(name, 0, owner, [(OpKind.FLOOR, 0, 2)])]) == [ApplyResult.APPLIED]
    assert client.zrange(settled, 0, -1, withscores=True) == [(b"_", 9), (b"10", 10), (b"12", 12)]
    claimed = store.claim(name, 0)
    assert (claimed.floor, claimed.settled) == (9, frozenset({10, 12}))
    assert store.settled_from(name, {0: 3}) == {0: (9, [10, 12])}  # the floor is above the commit
    assert store.settled_from(name, {0: 11}) == {0: (11, [12])}


def test_first_attempts_are_runs_that_a_claim_reads_under_later_fields(endpoints: Any,
                                                                       unique_name: Callable[[str], str]) -> None:
    """ACK-4, ACK-6: first attempts are written as runs of consecutive offsets (delivered 1, released
    -1; a batch's runs of one value in one member), later attempts and starts as fields; a settle
    deletes the field only when it says one may exist; a claim charges each unsettled offset its
    field, else its run's attempt; the floor drops the members wholly below it."""
    store = StateStore(endpoints.redis_url)
    name = unique_name("firsts")
    owner = store.claim(name, 0).epoch
    first: list[Op] = [
        (OpKind.FIRST_DELIVERED, 10, 1), (OpKind.FIRST_DELIVERED, 12, 1), (OpKind.FIRST_RELEASED, 13, 1),
        (OpKind.FIRST_DELIVERED, 11, 1), (OpKind.FIRST_DELIVERED, 14, 1), (OpKind.FIRST_RELEASED, 15, 1),
        (OpKind.FIRST_RELEASED, 16, 1), (OpKind.BATCH_LEASE, 0, 5000), (OpKind.BATCH_FIRST_RELEASED, 17, 1),
        (OpKind.STARTED, 13, 1), (OpKind.NACKED, 11, 1)]
    later: list[Op] = [(OpKind.DELIVERED, 11, 2), (OpKind.SETTLED, 10, 3), (OpKind.SETTLED, 13, 1),
                       (OpKind.SETTLED, 12, 3)]
    assert store.apply_many([(name, 0, owner, first), (name, 0, owner, later)]) == [ApplyResult.APPLIED] * 2
    attempts, leases = partition_keys(name, 0)[2:]
    client = store.client
    # One member per value and batch, listing its stretches of consecutive offsets, scored by the highest.
    assert client.zrange(firsts_key(name, 0), 0, -1, withscores=True) == [
        (b"10,12,14,14,1", 14), (b"13,13,15,17,-1", 17)]
    assert client.hgetall(attempts) == {b"_": b"0", b"11": b"2"}
    assert client.hgetall(leases) == {b"_": b"0", b"17": b"5000"}
    claimed = store.claim(name, 0)
    assert claimed.settled == {10, 12, 13}
    assert (claimed.attempts, claimed.unstarted) == ({11: 2, 14: 1, 15: 1, 16: 1, 17: 1}, frozenset({15, 16, 17}))
    epoch = claimed.epoch
    assert store.apply_many([(name, 0, epoch, [(OpKind.SETTLED, 11, 1), (OpKind.SETTLED, 14, 3),
                                               (OpKind.FLOOR, 0, 15)])]) == [ApplyResult.APPLIED]
    assert client.zrange(firsts_key(name, 0), 0, -1) == [b"13,13,15,17,-1"]  # 13 is below the floor
    again = store.claim(name, 0)
    assert (again.floor, again.settled, again.attempts) == (15, frozenset(), {15: 1, 16: 1, 17: 1})
    store.delete_subscription(name)
    assert not client.exists(firsts_key(name, 0))


def test_a_batch_naming_another_command_is_refused_before_any_write(endpoints: Any,
                                                                   unique_name: Callable[[str], str]) -> None:
    """``apply.lua`` takes only the state writes, each on its own key; any other batch writes nothing."""
    store = StateStore(endpoints.redis_url)
    name = unique_name("refused")
    owner = store.claim(name, 0).epoch
    keys = [*partition_keys(name, 0), cascades_key(name, 0)]
    sha = store._shas["apply"]
    for header, runs in [("3,HSET;3,DEL;", [b"\x92\xa11\xa11", b"\x90"]), ("2,HSET;", [b"\x92\xa11\xa11"]),
                         ("3,HSET;", [b"\x92\xa11\xa11", b"\x92\xa12\xa11"])]:
        with pytest.raises(redis.ResponseError, match=r"apply\.lua"):
            store.client.execute_command("EVALSHA", sha, len(keys), *keys, owner, header, *runs)
    assert store.client.hlen(keys[2]) == 0 and store.client.zcard(keys[1]) == 0


def test_a_flush_of_ops_held_over_an_outage_applies_in_one_call(endpoints: Any,
                                                               unique_name: Callable[[str], str]) -> None:
    """ACK-4: after a Redis outage the ops of every flush it failed go in one call; runs of tens of
    thousands of fields are sent in chunks that Lua's stack takes."""
    store = StateStore(endpoints.redis_url)
    name = unique_name("outage")
    owner = store.claim(name, 0).epoch
    count = 60_000
    ops: list[Op] = [(OpKind.BATCH_LEASE, 0, 1000)]
    ops += [(OpKind.BATCH_RELEASED, offset, 1) for offset in range(count)]
    ops += [(OpKind.SETTLED, offset, 0) for offset in range(count - 1)]
    assert store.apply_many([(name, 0, owner, ops)]) == [ApplyResult.APPLIED]
    _, settled, attempts, leases = partition_keys(name, 0)
    client = store.client
    assert client.zcard(settled) == count - 1
    assert client.hgetall(attempts) == {b"_": b"0", str(count - 1).encode(): b"-1"}
    assert client.hgetall(leases) == {b"_": b"0", str(count - 1).encode(): b"1000"}


def test_flushes_written_back_to_back_on_one_connection_apply_in_the_order_written(
        endpoints: Any, unique_name: Callable[[str], str]) -> None:
    """ACK-4, ACK-5: ``ApplyPipe`` writes a second flush before the first's answer is read; Redis runs
    them in the order written (a release, its nack and the next release of one offset end as the last
    left them) and the answers are read in that order, fencing included."""
    store = StateStore(endpoints.redis_url)
    pipe = ApplyPipe(store)
    name = unique_name("pipe")
    zombie = store.claim(name, 0).epoch
    owner = store.claim(name, 0).epoch
    first = pipe.send([(name, 0, owner, "r,5,1;d,6,1;")])
    second = pipe.send([(name, 0, owner, "n,5,1;r,5,2;a,6,0;"), (name, 0, zombie, "a,5,0;")])
    assert pipe.receive(first) == [ApplyResult.APPLIED]
    assert pipe.receive(second) == [ApplyResult.APPLIED, ApplyResult.FENCED]
    _, settled, attempts, _ = partition_keys(name, 0)
    assert store.client.hgetall(attempts) == {b"_": b"0", b"5": b"-2"}
    assert store.client.zrange(settled, 0, -1) == [b"6"]
    pipe.close()


def test_a_pipe_reloads_a_lost_script_and_leaves_a_failed_connection(endpoints: Any,
                                                                     unique_name: Callable[[str], str]) -> None:
    """ACK-4: a pipe's first flush on a server without the script is applied (the script is loaded
    with each new connection); after Redis lost its scripts, the flushes written meanwhile answer
    NOSCRIPT (raised once all their answers are read) and the script is loaded for the next; a
    connection that failed with flushes in flight fails them all, and the next flush goes out on a
    new connection."""
    store = StateStore(endpoints.redis_url)
    pipe = ApplyPipe(store)
    name = unique_name("pipe")
    owner = store.claim(name, 0).epoch
    store.client.script_flush()  # type: ignore[union-attr]
    connected_before = pipe.ready  # the first send connects
    assert pipe.receive(pipe.send([(name, 0, owner, "r,1,1;")])) == [ApplyResult.APPLIED]
    assert (connected_before, pipe.ready) == (False, True)
    store.client.script_flush()  # type: ignore[union-attr]
    lost = pipe.send([(name, 0, owner, "r,2,1;"), (name, 0, owner, "r,3,1;")])
    with pytest.raises(redis.exceptions.NoScriptError):
        pipe.receive(lost)
    assert pipe.receive(pipe.send([(name, 0, owner, "r,2,1;")])) == [ApplyResult.APPLIED]

    connection = first_connection = pipe.send([(name, 0, owner, "r,9,1;")])
    assert pipe.receive(connection) == [ApplyResult.APPLIED]
    host, port = first_connection.connection._sock.getsockname()[:2]
    store.client.client_kill_filter(addr=f"{host}:{port}")
    wait_until(lambda: f"{host}:{port}" not in {client["addr"] for client in store.client.client_list()}, 10,
               "the pipe's connection closed by Redis")
    in_flight = [pipe.send([(name, 0, owner, "r,10,1;")])]
    with contextlib.suppress(redis.exceptions.ConnectionError):  # the write may meet the closed connection
        in_flight.append(pipe.send([(name, 0, owner, "r,11,1;")]))
    for sent in in_flight:
        with pytest.raises(redis.exceptions.ConnectionError):
            pipe.receive(sent)
    assert not pipe.ready  # the next send connects again
    after = pipe.send([(name, 0, owner, "r,12,1;")])
    assert after.connection is not first_connection.connection
    assert pipe.receive(after) == [ApplyResult.APPLIED]
    pipe.close()
