"""Order restoring in Spark: grouped by ordering key, batch and streaming (SPK-2, SPK-3).

Both run ``ordering.restore_frame`` in Python workers. The batch form groups by a bucket of the
ordering key (``pmod(hash(ordering_key), key_buckets)``) so that each Python call restores many
whole keys at once: one call per key would cost a pandas round trip per key, which dominates at
many small keys. The streaming form keeps per-key state with ``applyInPandasWithState``.

Unordered messages (no ordering key) are not grouped: the batch form only drops duplicate message
ids among them; the streaming form emits each message id once (per-id state under the same
timeout). Undecodable records (``error`` set) never reach the output; those with a readable key
mark gaps in their key's sequence (see ``ordering``), and ``undecodable()`` lists them all.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pandas as pd
from pyspark.sql import DataFrame
from pyspark.sql import functions as F  # noqa: N812 - Spark's own idiom
from pyspark.sql.streaming.state import GroupState, GroupStateTimeout
from pyspark.sql.types import BooleanType, LongType, StringType, StructField, StructType

from ordering_layer.spark.ordering import GAP, KEY, KEY_SEQUENCE, LATE, KeyProgress, restore_frame

_LOGGER = logging.getLogger(__name__)

DEFAULT_KEY_BUCKETS = 256
_BUCKET = "_key_bucket"
_UNORDERED_ID = "_unordered_id"
_EVENT_MS = "_event_ms"

STATE = StructType([
    StructField("emitted", LongType()),
    StructField("partition_count", LongType()),
    StructField("rerouted", BooleanType()),
    StructField("offset", LongType()),
    StructField("partition", LongType()),
    StructField("pending_gap", BooleanType()),
    # A JSON list: array columns in the state schema do not reach the Python worker intact in 4.2.
    StructField("seen_ids", StringType()),
])


def _output_schema(df: DataFrame, *, late: bool) -> StructType:
    fields = [field for field in df.schema.fields if field.name not in ("error", _BUCKET, _UNORDERED_ID, _EVENT_MS)]
    extra = [StructField(KEY_SEQUENCE, LongType()), StructField(GAP, BooleanType(), False)]
    if late:
        extra.append(StructField(LATE, BooleanType(), False))
    return StructType(fields + extra)


def _restore_bucket(frame: pd.DataFrame) -> pd.DataFrame:
    """``applyInPandas`` body: every key of one bucket, restored at once."""
    return restore_frame(frame.drop(columns=[_BUCKET])).messages.drop(columns=[LATE])


def restore_order(df: DataFrame, *, key_buckets: int = DEFAULT_KEY_BUCKETS) -> DataFrame:
    """Each ordering key's messages in sequence order, deduplicated and numbered (SPK-2).

    Args:
        df: a ``read_ordered`` DataFrame (extra columns pass through).
        key_buckets: groups the keys are hashed into; each group is restored by one Python call
            and must fit in a Python worker's memory (rows / key_buckets on average).

    Returns:
        The decodable messages without ``error``, plus ``key_sequence`` (1..n per key in sequence
        order ``(partition_count, offset)``, duplicates of a message id dropped) and ``gap`` (true
        when an undecodable record of the key sits just before the message, see
        ``ordering_layer.spark.ordering``). Unordered messages keep one row per message id, with
        null ``key_sequence``. Row order is Spark's; sort by ``ordering_key, key_sequence``.
    """
    if key_buckets < 1:
        raise ValueError(f"key_buckets must be >= 1, got {key_buckets}")
    schema = _output_schema(df, late=False)
    keyed = (df.where(F.col(KEY).isNotNull())
             .withColumn(_BUCKET, F.pmod(F.hash(F.col(KEY)), F.lit(key_buckets))))
    ordered = keyed.groupBy(_BUCKET).applyInPandas(_restore_bucket, schema=schema)
    unordered = (df.where(F.col(KEY).isNull() & F.col("error").isNull())
                 .dropDuplicates(["message_id"])
                 .drop("error")
                 .withColumn(KEY_SEQUENCE, F.lit(None).cast(LongType()))
                 .withColumn(GAP, F.lit(False)))
    return ordered.unionByName(unordered)


def _progress_from_state(state: GroupState) -> KeyProgress | None:
    if not state.exists:
        return None
    emitted, count, rerouted, offset, partition, pending, seen = state.get
    return KeyProgress(int(emitted), count, rerouted, offset, partition, bool(pending), tuple(json.loads(seen or "[]")))


def _restore_group(key: tuple[Any, ...], frames: Iterator[pd.DataFrame], state: GroupState, *,
                   timeout_ms: int, keep_ids: int) -> Iterator[pd.DataFrame]:
    """``applyInPandasWithState`` body for one ordering key (or one unordered message id)."""
    if state.hasTimedOut:
        state.remove()
        return
    frame = pd.concat(list(frames), ignore_index=True)
    last_event_ms = int(frame[_EVENT_MS].max())
    frame = frame.drop(columns=[_UNORDERED_ID, _EVENT_MS])
    previous = _progress_from_state(state)
    ordering_key = key[0]
    if pd.isna(ordering_key):  # a null key may arrive as None or NaN
        if previous is None:
            first = frame[frame["error"].isna()].head(1).drop(columns=["error"])
            state.update((1, None, None, None, None, False, "[]"))
            yield first.assign(**{KEY_SEQUENCE: pd.array([None] * len(first), dtype="Int64"), GAP: False,
                                  LATE: False})
    else:
        restored = restore_frame(frame, {ordering_key: previous} if previous else None, track=True,
                                 keep_ids=keep_ids)
        progress = restored.progress.get(ordering_key, previous)
        if progress is not None:
            state.update((progress.emitted, progress.partition_count, progress.rerouted, progress.offset,
                          progress.partition, progress.pending_gap, json.dumps(progress.seen_ids)))
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
        the next number rather than dropped.
    """
    schema = _output_schema(df, late=True)
    grouped = (df.withWatermark("enqueued_time", f"{late_delay} seconds")
               .where(F.col(KEY).isNotNull() | F.col("error").isNull())
               .withColumn(_UNORDERED_ID, F.when(F.col(KEY).isNull(), F.col("message_id")))
               .withColumn(_EVENT_MS, F.unix_millis("enqueued_time"))
               .groupBy(KEY, _UNORDERED_ID))
    timeout_ms = int(state_timeout * 1000)

    def restore_group(key: tuple[Any, ...], frames: Iterator[pd.DataFrame],
                      state: GroupState) -> Iterator[pd.DataFrame]:
        return _restore_group(key, frames, state, timeout_ms=timeout_ms, keep_ids=keep_ids)

    return grouped.applyInPandasWithState(restore_group, schema, STATE, "append",
                                          GroupStateTimeout.EventTimeTimeout)
