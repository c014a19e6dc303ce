"""Order restoring in Spark: grouped by ordering key, batch and streaming (SPK-2, SPK-3, PUB-7).

Both run ``ordering.plan_restore`` in Python workers, grouped by the exact bytes of the key
(``key``), never by its text form.

The batch form groups the way ``groupBy(key)`` does inside Spark (hash-partition by key, sort by
key within each partition, in the JVM) and then restores each partition with one ``mapInArrow``
call that takes its Arrow batches in turn: the keys complete in a batch are restored at once, and
only the rows of the batch's last key are held back until the key's rows are complete.
``groupBy().applyInPandas`` would call Python once per key, and that round trip (about 10 ms)
dominates when keys are many and small; here the cost is per batch, and memory is one batch plus
one key. Only the columns that decide the order are converted to NumPy; the rest (data,
attributes, ...) are taken from the Arrow batches as they are.

The streaming form keeps per-key state with ``applyInPandasWithState``.

Unordered messages (no ordering key) are not grouped by key: both forms group them by message id,
so each id is emitted once (the streaming form keeps per-id state under the same timeout). Every
record is a message, whoever wrote it; a key whose order the data does not define (records
without the partition-count header in two partitions, PUB-7) has all its messages emitted with
``order_undefined`` set (see ``ordering``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame
from pyspark.sql import functions as F  # noqa: N812 - Spark's own idiom
from pyspark.sql.streaming.state import GroupState, GroupStateTimeout
from pyspark.sql.types import BooleanType, LongType, StringType, StructField, StructType

from ordering_layer.spark.ordering import (
    KEY,
    KEY_SEQUENCE,
    LATE,
    ORDER_UNDEFINED,
    Array,
    KeyProgress,
    Records,
    keys_of,
    plan_restore,
    restore_frame,
)

_LOGGER = logging.getLogger(__name__)

_UNORDERED_ID = "_unordered_id"
_EVENT_MS = "_event_ms"

STATE = StructType([
    StructField("emitted", LongType()),
    StructField("partition_count", LongType()),
    StructField("rerouted", BooleanType()),
    StructField("offset", LongType()),
    StructField("partition", LongType()),
    StructField("order_undefined", BooleanType()),
    # A JSON list: array columns in the state schema do not reach the Python worker intact in 4.2.
    StructField("seen_ids", StringType()),
])


def _output_schema(df: DataFrame, *, late: bool) -> StructType:
    fields = [field for field in df.schema.fields if field.name not in (_UNORDERED_ID, _EVENT_MS)]
    extra = [StructField(KEY_SEQUENCE, LongType()), StructField(ORDER_UNDEFINED, BooleanType(), False)]
    if late:
        extra.append(StructField(LATE, BooleanType(), False))
    return StructType(fields + extra)


def _concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """``pd.concat``, with Arrow-backed string columns turned into object columns: concatenated,
    they hold chunked arrays, which pyspark's pandas-to-Arrow conversion refuses."""
    if len(frames) == 1:
        return frames[0]
    frame = pd.concat(frames, ignore_index=True)
    for name, column in frame.items():
        if isinstance(column.dtype, pd.StringDtype | pd.ArrowDtype):
            frame[name] = column.astype(object)
    return frame


def _records_of(table: pa.Table) -> Records:
    """The columns order restoring reads, from an Arrow table of ``_by_group`` rows."""
    def values(name: str) -> Array:
        return np.asarray(table.column(name).to_numpy(zero_copy_only=False))

    return Records(values(KEY), values("message_id"), values("partition").astype(np.int64),
                   values("offset").astype(np.int64),
                   np.asarray(table.column("partition_count").cast(pa.float64()).to_numpy(zero_copy_only=False)))


def _restore_batches(batches: list[pa.RecordBatch]) -> list[pa.RecordBatch]:
    """Restore complete groups; the passing-through columns never leave Arrow."""
    table = pa.Table.from_batches(batches)
    plan = plan_restore(_records_of(table))
    out = table.take(pa.array(plan.rows, type=pa.int64())).drop_columns([_UNORDERED_ID])
    out = out.append_column(KEY_SEQUENCE, pa.array(plan.key_sequence, type=pa.int64(), mask=~plan.ordered))
    restored: list[pa.RecordBatch] = out.append_column(
        ORDER_UNDEFINED, pa.array(plan.order_undefined, type=pa.bool_())).to_batches()
    return restored


def _group_of(batch: pa.RecordBatch, row: int) -> tuple[Any, Any]:
    """The group of a row: its ordering key, and for an unordered message its id."""
    return batch.column(KEY)[row].as_py(), batch.column(_UNORDERED_ID)[row].as_py()


def _last_group_start(batch: pa.RecordBatch) -> int:
    """Where the rows of the batch's last group begin (the batch is sorted by group)."""
    held: Any = None
    for name, value in zip((KEY, _UNORDERED_ID), _group_of(batch, -1), strict=True):
        column = batch.column(name)
        same = pc.is_null(column) if value is None else pc.fill_null(pc.equal(column, value), False)
        held = same if held is None else pc.and_(held, same)
    others = np.flatnonzero(~np.asarray(held.to_numpy(zero_copy_only=False), dtype=bool))
    return int(others[-1]) + 1 if len(others) else 0


def _restore_partition(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """``mapInArrow`` body over one partition sorted by group: restore every group once complete."""
    pending: list[pa.RecordBatch] = []  # the rows so far of the group the last batch ended with
    for batch in batches:
        if batch.num_rows == 0:
            continue
        start = _last_group_start(batch)
        if start == 0:
            if pending and _group_of(pending[-1], -1) != _group_of(batch, -1):
                yield from _restore_batches(pending)
                pending = []
            pending.append(batch)
            continue
        # Everything before the last group is complete, the pending group's rest included.
        yield from _restore_batches([*pending, batch.slice(0, start)])
        pending = [batch.slice(start)]
    if pending:
        yield from _restore_batches(pending)


def _by_group(df: DataFrame) -> DataFrame:
    """``df`` with the group of each row: its key, or for an unordered message its id
    (``_unordered_id``)."""
    return df.withColumn(_UNORDERED_ID, F.when(F.col(KEY).isNull(), F.col("message_id")))


def restore_order(df: DataFrame, *, partitions: int | None = None) -> DataFrame:
    """Each ordering key's messages in sequence order, deduplicated and numbered (SPK-2).

    Args:
        df: a ``read_ordered`` DataFrame (extra columns pass through).
        partitions: how many partitions the keys are hashed into (default:
            ``spark.sql.shuffle.partitions``).

    Returns:
        The messages with the columns of ``df``, plus ``key_sequence`` (1..n per key in sequence
        order ``(partition_count, offset)``, records without the partition-count header placed by
        offset within their partition, duplicates of a message id dropped) and ``order_undefined``
        (true for every message of a key whose order the data does not define, PUB-7; see
        ``ordering_layer.spark.ordering``). Unordered messages keep one row per message id, with
        null ``key_sequence``. Row order is Spark's; sort by ``key, key_sequence``.

    Raises:
        ValueError: ``partitions`` < 1.
    """
    if partitions is not None and partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    schema = _output_schema(df, late=False)
    # An explicit count: adaptive execution would otherwise coalesce small inputs into fewer
    # partitions than there are cores.
    count = partitions or int(df.sparkSession.conf.get("spark.sql.shuffle.partitions") or 200)
    return (_by_group(df).repartition(count, KEY, _UNORDERED_ID)
            .sortWithinPartitions(KEY, _UNORDERED_ID)
            .mapInArrow(_restore_partition, schema))


def _progress_from_state(state: GroupState) -> KeyProgress | None:
    if not state.exists:
        return None
    emitted, count, rerouted, offset, partition, undefined, seen = state.get
    return KeyProgress(int(emitted), count, rerouted, offset, partition, bool(undefined),
                       tuple(json.loads(seen or "[]")))


def _restore_group(key: tuple[Any, ...], frames: Iterator[pd.DataFrame], state: GroupState, *,
                   timeout_ms: int, keep_ids: int) -> Iterator[pd.DataFrame]:
    """``applyInPandasWithState`` body for one ordering key (or one unordered message id)."""
    if state.hasTimedOut:
        state.remove()
        return
    frame = _concat(list(frames))
    last_event_ms = int(frame[_EVENT_MS].max())
    frame = frame.drop(columns=[_UNORDERED_ID, _EVENT_MS])
    previous = _progress_from_state(state)
    ordering_key = keys_of(np.array([key[0]], dtype=object))[0]  # None, or the key's bytes
    if ordering_key is None:
        if previous is None:
            state.update((1, None, None, None, None, False, "[]"))
            yield restore_frame(frame).messages
    else:
        restored = restore_frame(frame, {ordering_key: previous} if previous else None, track=True,
                                 keep_ids=keep_ids)
        progress = restored.progress.get(ordering_key, previous)
        if progress is not None:
            state.update((progress.emitted, progress.partition_count, progress.rerouted, progress.offset,
                          progress.partition, progress.order_undefined, json.dumps(progress.seen_ids)))
        yield restored.messages
    if state.exists:
        state.setTimeoutTimestamp(max(last_event_ms + timeout_ms, state.getCurrentWatermarkMs() + 1))


def restore_order_stream(df: DataFrame, *, state_timeout: float = 3600.0, late_delay: float = 3600.0,
                         keep_ids: int = 1000) -> DataFrame:
    """Structured Streaming order restoring with per-key state across micro-batches (SPK-3).

    Each micro-batch's messages of a key are sorted, deduplicated against the key's recent
    message ids and numbered on from the key's count, so each message is emitted once and, per
    key, in sequence order. Works with any trigger, ``availableNow`` included; use output mode
    ``append``.

    State is bounded by event time: the watermark is the latest ``enqueued_time`` seen minus
    ``late_delay``, and a key's state is dropped once the watermark passes its last message's
    ``enqueued_time`` plus ``state_timeout``. After that, a later message of the key starts a new
    sequence at 1, and duplicates of its earlier messages are no longer recognised. Spark drops
    input rows older than the watermark (counted as ``numRowsDroppedByWatermark`` in the query
    progress), so ``late_delay`` must exceed how far the append times of one micro-batch's
    partitions can lag each other.

    Args:
        df: a ``read_ordered_stream`` DataFrame.
        state_timeout: seconds of event time a key's state outlives its last message.
        late_delay: watermark delay in seconds.
        keep_ids: how many recent message ids per key are kept to drop duplicates.

    Returns:
        The columns of ``restore_order`` plus ``late``: true for a message that sorts before one
        an earlier micro-batch already emitted for its key (possible only when a record of the
        old partition arrives after the key moved to a new partition count); it is emitted with
        the next number rather than dropped. A key found without a defined order (PUB-7) keeps
        ``order_undefined`` set in the micro-batches that follow.
    """
    schema = _output_schema(df, late=True)
    grouped = (_by_group(df.withWatermark("enqueued_time", f"{late_delay} seconds"))
               .withColumn(_EVENT_MS, F.unix_millis("enqueued_time"))
               .groupBy(KEY, _UNORDERED_ID))
    timeout_ms = int(state_timeout * 1000)

    def restore_group(key: tuple[Any, ...], frames: Iterator[pd.DataFrame],
                      state: GroupState) -> Iterator[pd.DataFrame]:
        return _restore_group(key, frames, state, timeout_ms=timeout_ms, keep_ids=keep_ids)

    return grouped.applyInPandasWithState(restore_group, schema, STATE, "append",
                                          GroupStateTimeout.EventTimeTimeout)
