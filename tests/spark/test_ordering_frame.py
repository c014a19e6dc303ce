"""The order-restoring logic that Spark runs in its Python workers, on pandas frames (no JVM)."""

from __future__ import annotations

import json
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest
from pyspark.sql import Row
from pyspark.sql.streaming.state import GroupState, GroupStateTimeout

from ordering_layer.kafka.partitioner import partition_for
from ordering_layer.spark.ordering import KeyProgress, restore_frame
from ordering_layer.spark.restore import STATE, _restore_group, _restore_partition

pytestmark = pytest.mark.spark

KEY = b"a"  # routed to different partitions by 3 and by 5 partitions
HOME3 = partition_for(KEY, 3)
HOME5 = partition_for(KEY, 5)
OTHER = next(p for p in range(5) if p not in (HOME3, HOME5))


def record(message_id: str | None, partition: int, offset: int, count: int | None, *,
           key: bytes | None = KEY) -> dict[str, Any]:
    """A row of ``read_ordered``; a record without a count has no ``ol-partition-count`` header, and
    without a message id header its id is the sequence number."""
    return {"key": key, "message_id": message_id if message_id is not None else str(partition << 48 | offset),
            "partition": partition, "offset": offset, "partition_count": count, "data": b""}


def frame(*rows: dict[str, Any]) -> pd.DataFrame:
    return pd.DataFrame(list(rows))


def ids(result: pd.DataFrame) -> list[str]:
    return list(result["message_id"])


def test_sequence_order_across_partition_counts_and_rerouted_copies() -> None:
    """SPK-2: order is (partition count at publish, offset); a copy in a partition its count does
    not route its key to sorts after the key's routed records, so the original keeps its place."""
    result = restore_frame(frame(
        record("m5", HOME5, 2, 5),
        record("m2", HOME3, 40, 3),
        record("m1", HOME3, 30, 3),
        record("m2", OTHER, 0, 3),      # copy of m2 written by another partitioner, low offset
        record("m3", HOME3, 50, 3),
        record("m1", HOME3, 60, 3),     # retry copy behind later messages
        record("m4", OTHER, 1, 3),      # only a rerouted record exists for m4
    )).messages
    assert ids(result) == ["m1", "m2", "m3", "m4", "m5"]
    assert list(result["key_sequence"]) == [1, 2, 3, 4, 5]
    assert not result["order_undefined"].any() and not result["late"].any()
    assert list(result.loc[result["message_id"] == "m2", "partition"]) == [HOME3]


def test_keys_are_independent_and_compared_as_bytes() -> None:
    """SPK-2 / PUB-7: each key is numbered on its own; the same message id under two keys is two
    messages; keys that differ in bytes are two keys even where their text forms agree
    (``b"\\xff"`` not UTF-8, shown as ``\\xff``, and the UTF-8 text ``\\xff``)."""
    other, raw, text = b"another", b"\xff", b"\\xff"
    result = restore_frame(frame(
        record("a2", HOME3, 5, 3), record("a1", HOME3, 1, 3),
        record("a1", partition_for(other, 3), 7, 3, key=other),
        record(None, 0, 3, None, key=raw), record(None, 0, 4, None, key=text), record(None, 0, 9, None, key=raw),
    )).messages
    assert [(row.key, row.key_sequence) for row in result.itertuples()] == [
        (text, 1), (KEY, 1), (KEY, 2), (other, 1), (raw, 1), (raw, 2)]
    assert ids(result)[1:3] == ["a1", "a2"]
    assert not result["order_undefined"].any()


def test_plain_producer_key_in_one_partition_is_ordered_by_offset() -> None:
    """PUB-7: records of another producer (no ol- headers, ids = sequence numbers), one partition
    per key, come in offset order, numbered, and are not flagged."""
    other = b"other"
    result = restore_frame(frame(*(record(None, 2, offset, None) for offset in (30, 10, 20)),
                                 record(None, 1, 5, None, key=other), record(None, 1, 2, None, key=other))).messages
    assert [(row.key, row.offset, row.key_sequence) for row in result.itertuples()] == [
        (KEY, 10, 1), (KEY, 20, 2), (KEY, 30, 3), (other, 2, 1), (other, 5, 2)]
    assert not result["order_undefined"].any()


def test_plain_producer_key_in_two_partitions_is_flagged() -> None:
    """PUB-7: a key whose records without the partition-count header sit in two partitions has no
    defined order: every message is still emitted and numbered, all flagged; other keys are not."""
    result = restore_frame(frame(record(None, 0, 1, None), record(None, 1, 0, None), record(None, 0, 2, None),
                                 record(None, 1, 7, None, key=b"other"))).messages
    mine = result[result["key"] == KEY]
    assert sorted(mine["offset"]) == [0, 1, 2] and list(mine["key_sequence"]) == [1, 2, 3]
    assert mine["order_undefined"].all()
    assert not result.loc[result["key"] == b"other", "order_undefined"].any()


def test_headerless_records_placed_between_adjacent_neighbours() -> None:
    """PUB-7: a record without the header sorts by offset within its partition: between its key's
    headered neighbours there when they are adjacent in sequence order, or first or last."""
    result = restore_frame(frame(
        record("m1", HOME3, 10, 3), record(None, HOME3, 11, None), record("m2", HOME3, 12, 3),
        record(None, HOME3, 4, None),                        # before everything
        record("m3", HOME5, 3, 5), record(None, HOME5, 4, None), record(None, HOME5, 8, None),  # after
        record("m2", OTHER, 0, 3),                           # a rerouted copy, dropped as a duplicate
    )).messages
    assert [(row.partition, row.offset) for row in result.itertuples()] == [
        (HOME3, 4), (HOME3, 10), (HOME3, 11), (HOME3, 12), (HOME5, 3), (HOME5, 4), (HOME5, 8)]
    assert not result["order_undefined"].any()


@pytest.mark.parametrize("stray", [
    record(None, HOME3, 20, None),  # after m1 in its partition, but m2 of another partition follows m1
    record(None, OTHER, 9, None),   # no headered record of the key in its partition
])
def test_headerless_record_that_cannot_be_placed_flags_the_key(stray: dict[str, Any]) -> None:
    """PUB-7: a record without the header whose place against records of other partitions the data
    does not define flags its key instead of being guessed into place; all messages are emitted."""
    result = restore_frame(frame(record("m1", HOME3, 10, 3), record("m2", HOME5, 2, 5), stray,
                                 record("x1", 0, 1, 3, key=b"x"))).messages
    mine = result[result["key"] == KEY]
    assert ids(mine)[:2] == ["m1", "m2"] and len(mine) == 3
    assert mine["order_undefined"].all()
    assert not result.loc[result["key"] == b"x", "order_undefined"].any()


def test_progress_carries_numbering_duplicates_and_lateness_across_frames() -> None:
    """SPK-3: with the previous micro-batch's progress, numbering continues, ids seen before are
    dropped, and a message sorting before an emitted one is flagged late."""
    first = restore_frame(frame(record("m1", HOME3, 1, 3), record("m2", HOME3, 2, 3)), track=True)
    assert first.progress[KEY] == KeyProgress(2, 3, False, 2, HOME3, False, ("m1", "m2"))

    second = restore_frame(frame(record("m2", HOME3, 9, 3), record("m3", HOME3, 4, 3), record("m0", HOME3, 0, 3)),
                           first.progress, track=True, keep_ids=2)
    assert ids(second.messages) == ["m0", "m3"]
    assert list(second.messages["key_sequence"]) == [3, 4]
    assert list(second.messages["late"]) == [True, False]
    assert second.progress[KEY] == KeyProgress(4, 3, False, 4, HOME3, False, ("m0", "m3"))


def test_progress_of_a_plain_producer_key_across_frames() -> None:
    """SPK-3 / PUB-7: a key without headers goes on by offset in its partition across micro-batches;
    its records appearing in a second partition flag it, and the flag stays."""
    first = restore_frame(frame(record(None, 2, 5, None), record(None, 2, 3, None)), track=True)
    assert list(first.messages["offset"]) == [3, 5]
    assert first.progress[KEY] == KeyProgress(2, None, False, 5, 2, False, (str(2 << 48 | 3), str(2 << 48 | 5)))

    second = restore_frame(frame(record(None, 2, 8, None), record(None, 2, 6, None)), first.progress, track=True)
    assert list(second.messages["offset"]) == [6, 8] and list(second.messages["key_sequence"]) == [3, 4]
    assert not second.messages["order_undefined"].any() and not second.messages["late"].any()

    third = restore_frame(frame(record(None, 0, 1, None)), second.progress, track=True)
    assert third.messages["order_undefined"].all() and list(third.messages["key_sequence"]) == [5]
    fourth = restore_frame(frame(record(None, 0, 2, None)), third.progress, track=True)
    assert fourth.messages["order_undefined"].all() and fourth.progress[KEY].order_undefined


def test_unordered_messages_once_per_id() -> None:
    """SPK-2: unordered messages pass through once per message id, without a key sequence."""
    result = restore_frame(frame(record("u1", 0, 1, 3, key=None), record("m1", HOME3, 2, 3),
                                 record("u1", 1, 9, 3, key=None), record("u2", 2, 3, 3, key=None),
                                 record(None, 2, 4, None, key=None))).messages
    assert ids(result) == ["m1", "u1", "u2", str(2 << 48 | 4)]
    assert result["key_sequence"].iloc[0] == 1
    result = result[result["key"].isna()]
    assert result["key_sequence"].isna().all() and not result["order_undefined"].any()


def _state(value: tuple[Any, ...] | None, *, timed_out: bool = False) -> GroupState:
    """The state Spark hands ``_restore_group``: event-time timeout, watermark at 1 s."""
    return GroupState(optionalValue=Row(*value) if value is not None else None, batchProcessingTimeMs=0,
                      eventTimeWatermarkMs=1_000, timeoutConf=GroupStateTimeout.EventTimeTimeout,
                      hasTimedOut=timed_out, watermarkPresent=True, defined=value is not None, updated=False,
                      removed=False, timeoutTimestamp=-1, keyAsUnsafe=b"", valueSchema=STATE)


def _stream_frame(*rows: dict[str, Any]) -> pd.DataFrame:
    return frame(*rows).assign(_unordered_id=None, _event_ms=5_000)


def test_stream_state_is_kept_and_bounded_by_its_timeout() -> None:
    """SPK-3: a key's state carries its progress between micro-batches with an event-time timeout
    past its last message; when the timeout fires the state is removed and nothing is emitted."""
    state = _state(None)
    out = list(_restore_group((KEY, None), iter([_stream_frame(record("m1", HOME3, 1, 3))]), state,
                              timeout_ms=60_000, keep_ids=10))
    assert ids(out[0]) == ["m1"]
    assert state.exists and state.get[:6] == (1, 3, False, 1, HOME3, False)
    assert json.loads(state.get[6]) == ["m1"]
    assert state.getCurrentWatermarkMs() < 65_000 == state._timeout_timestamp

    again = _state(state.get)
    out = list(_restore_group((KEY, None), iter([_stream_frame(record("m1", HOME3, 7, 3),
                                                               record("m2", HOME3, 8, 3))]),
                              again, timeout_ms=60_000, keep_ids=10))
    assert ids(out[0]) == ["m2"] and list(out[0]["key_sequence"]) == [2]

    expired = _state(again.get, timed_out=True)
    assert list(_restore_group((KEY, None), iter([]), expired, timeout_ms=60_000, keep_ids=10)) == []
    assert expired._removed


def test_stream_unordered_message_emitted_once() -> None:
    """SPK-3: an unordered message id is emitted the first time only."""
    state = _state(None)
    out = list(_restore_group((None, "u1"), iter([_stream_frame(record("u1", 0, 1, 3, key=None))]), state,
                              timeout_ms=60_000, keep_ids=10))
    assert ids(out[0]) == ["u1"]
    assert list(_restore_group((None, "u1"), iter([_stream_frame(record("u1", 1, 2, 3, key=None))]),
                               _state(state.get), timeout_ms=60_000, keep_ids=10)) == []


def test_partition_restored_batch_by_batch_equals_whole() -> None:
    """SPK-2 / PUB-7: a partition sorted by group and cut into Arrow batches anywhere (a key spread
    over several batches, a batch holding one key only) is restored exactly as one frame, flags
    included."""
    rows = []
    for k in range(4):
        key = f"key-{k}".encode()
        home = partition_for(key, 3)
        rows += [record(f"{key!r}-m{n}", home, 100 - n * 3 if k % 2 else n, 3, key=key) for n in range(7)]
        rows.append(record(f"{key!r}-m2", home, 200, 3, key=key))
    rows.append(record(None, (partition_for(b"key-1", 3) + 1) % 3, 90, None, key=b"key-1"))  # flags key-1
    rows += [record(None, 1, n, None, key=b"\xff\xfe") for n in (4, 2, 9)]
    rows += [record("u1", 0, 1, 3, key=None), record("u1", 1, 5, 3, key=None), record("u2", 2, 2, 3, key=None)]
    whole = frame(*rows).assign(_unordered_id=lambda f: f["message_id"].where(f["key"].isna()))
    whole = whole.sort_values(["key", "_unordered_id"], na_position="first", kind="stable", ignore_index=True)
    expected = restore_frame(whole.drop(columns=["_unordered_id"])).messages

    def rows_of(result: pd.DataFrame) -> list[tuple[Any, ...]]:
        return sorted(((r.key or b"", r.message_id, None if pd.isna(r.key_sequence) else int(r.key_sequence),
                        bool(r.order_undefined)) for r in result.itertuples()), key=str)

    schema = pa.schema([("key", pa.binary()), ("message_id", pa.string()), ("partition", pa.int32()),
                        ("offset", pa.int64()), ("partition_count", pa.int64()), ("data", pa.binary()),
                        ("_unordered_id", pa.string())])
    table = pa.Table.from_pandas(whole, schema=schema, preserve_index=False).combine_chunks()
    assert expected["order_undefined"].sum() == 8  # key-1: 7 messages (a copy dropped) and the stray
    for cuts in ([3], [1, 2, 10, 11, 12, 30], list(range(1, len(whole))), [8, 16, 24]):
        batches = [table.slice(a, b - a).to_batches()[0] for a, b in zip([0, *cuts], [*cuts, len(whole)], strict=True)]
        got = pa.Table.from_batches(list(_restore_partition(iter(batches)))).to_pandas()
        assert rows_of(got) == rows_of(expected), cuts
