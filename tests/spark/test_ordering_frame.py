"""The order-restoring logic that Spark runs in its Python workers, on pandas frames (no JVM)."""

from __future__ import annotations

import json
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest
from pyspark.sql import Row
from pyspark.sql.streaming.state import GroupState, GroupStateTimeout

from ordering_layer.publisher.partitioner import partition_for
from ordering_layer.spark.ordering import KeyProgress, restore_frame
from ordering_layer.spark.restore import STATE, _restore_group, _restore_partition

pytestmark = pytest.mark.spark

KEY = "k"
HOME3 = partition_for(KEY.encode(), 3)
HOME5 = partition_for(KEY.encode(), 5)
OTHER = next(p for p in range(5) if p not in (HOME3, HOME5))


def record(message_id: str | None, partition: int, offset: int, count: int | None, *, key: str | None = KEY,
           error: str | None = None) -> dict[str, Any]:
    return {"ordering_key": key, "message_id": message_id, "partition": partition, "offset": offset,
            "partition_count": count, "data": b"", "error": error}


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
    assert not result["gap"].any() and not result["late"].any()
    assert list(result.loc[result["message_id"] == "m2", "partition"]) == [HOME3]


def test_keys_are_independent() -> None:
    """SPK-2: each key is numbered on its own; the same message id under two keys is two messages."""
    other = "another"
    result = restore_frame(frame(
        record("a2", HOME3, 5, 3), record("a1", HOME3, 1, 3),
        record("a1", partition_for(other.encode(), 3), 7, 3, key=other),
    )).messages
    assert [(row.ordering_key, row.message_id, row.key_sequence) for row in result.itertuples()] == [
        (other, "a1", 1), (KEY, "a1", 1), (KEY, "a2", 2)]


def test_gap_after_undecodable_record_of_the_key() -> None:
    """SPK-2 / DLQ-4: an undecodable record of the key between two messages flags the next one,
    placed by its stamped count, or by the nearest message in its partition when the count header
    is unreadable; an undecodable copy of a delivered message is no gap."""
    result = restore_frame(frame(
        record("m1", HOME3, 10, 3),
        record("lost-1", HOME3, 11, 3, error="bad value"),
        record("m2", HOME3, 12, 3),
        record("m3", HOME3, 14, 3),
        record("m3", HOME3, 15, 3, error="bad value"),    # corrupt copy of m3
        record("m4", HOME5, 3, 5),
        record(None, HOME5, 4, None, error="no headers"),
        record("m5", HOME5, 6, 5),
    )).messages
    assert ids(result) == ["m1", "m2", "m3", "m4", "m5"]
    assert list(result["gap"]) == [False, True, False, False, True]


def test_undecodable_record_without_position_flags_nothing() -> None:
    """SPK-2: an undecodable record whose count is unreadable and whose key has no message in its
    partition cannot be placed in the sequence; it flags no gap (``undecodable()`` reports it)."""
    result = restore_frame(frame(record("m1", HOME3, 1, 3), record(None, OTHER, 0, None, error="no headers"),
                                 record("m2", HOME3, 2, 3))).messages
    assert not result["gap"].any()


def test_progress_carries_numbering_duplicates_and_gaps_across_frames() -> None:
    """SPK-3: with the previous micro-batch's progress, numbering continues, ids seen before are
    dropped, a gap after the last emitted message is carried, and a message sorting before an
    emitted one is flagged late."""
    first = restore_frame(frame(record("m1", HOME3, 1, 3), record("m2", HOME3, 2, 3),
                                record("lost", HOME3, 3, 3, error="bad value")), track=True)
    progress = first.progress[KEY]
    assert progress == KeyProgress(2, 3, False, 2, HOME3, True, ("m1", "m2"))

    second = restore_frame(frame(record("m2", HOME3, 9, 3), record("m3", HOME3, 4, 3), record("m0", HOME3, 0, 3)),
                           first.progress, track=True, keep_ids=2)
    assert ids(second.messages) == ["m0", "m3"]
    assert list(second.messages["key_sequence"]) == [3, 4]
    assert list(second.messages["late"]) == [True, False]
    assert list(second.messages["gap"]) == [False, True]
    assert second.progress[KEY] == KeyProgress(4, 3, False, 4, HOME3, False, ("m0", "m3"))


def test_unordered_messages_once_per_id() -> None:
    """SPK-2: unordered messages pass through once per message id, without a key sequence."""
    result = restore_frame(frame(record("u1", 0, 1, 3, key=None), record("m1", HOME3, 2, 3),
                                 record("u1", 1, 9, 3, key=None), record("u2", 2, 3, 3, key=None),
                                 record(None, 2, 4, None, key=None, error="no headers"))).messages
    assert ids(result) == ["m1", "u1", "u2"]
    assert result["key_sequence"].iloc[0] == 1
    result = result[result["ordering_key"].isna()]
    assert result["key_sequence"].isna().all() and not result["gap"].any()


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
    """SPK-2: a partition sorted by group and cut into Arrow batches anywhere (a key spread over
    several batches, a batch holding one key only) is restored exactly as one frame."""
    rows = []
    for k in range(4):
        key = f"key-{k}"
        home = partition_for(key.encode(), 3)
        rows += [record(f"{key}-m{n}", home, 100 - n * 3 if k % 2 else n, 3, key=key) for n in range(7)]
        rows.append(record(f"{key}-m2", home, 200, 3, key=key))
    rows.append(record(None, partition_for(b"key-1", 3), 90, None, key="key-1", error="no headers"))
    rows += [record("u1", 0, 1, 3, key=None), record("u1", 1, 5, 3, key=None), record("u2", 2, 2, 3, key=None)]
    whole = frame(*rows).assign(_unordered_id=lambda f: f["message_id"].where(f["ordering_key"].isna()))
    whole = whole.sort_values(["ordering_key", "_unordered_id"], na_position="first", kind="stable",
                              ignore_index=True)
    expected = restore_frame(whole.drop(columns=["_unordered_id"])).messages

    def rows_of(result: pd.DataFrame) -> list[tuple[Any, ...]]:
        return sorted(((r.ordering_key or "", r.message_id, None if pd.isna(r.key_sequence) else int(r.key_sequence),
                        bool(r.gap)) for r in result.itertuples()), key=str)

    schema = pa.schema([("ordering_key", pa.string()), ("message_id", pa.string()), ("partition", pa.int32()),
                        ("offset", pa.int64()), ("partition_count", pa.int32()), ("data", pa.binary()),
                        ("error", pa.string()), ("_unordered_id", pa.string())])
    table = pa.Table.from_pandas(whole, schema=schema, preserve_index=False).combine_chunks()
    assert any(expected["gap"])
    for cuts in ([3], [1, 2, 10, 11, 12, 30], list(range(1, len(whole))), [8, 16, 24]):
        batches = [table.slice(a, b - a).to_batches()[0] for a, b in zip([0, *cuts], [*cuts, len(whole)], strict=True)]
        got = pa.Table.from_batches(list(_restore_partition(iter(batches)))).to_pandas()
        assert rows_of(got) == rows_of(expected), cuts
