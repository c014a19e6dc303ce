"""Reading layer topics with Spark's own Kafka source, batch and streaming (SPK-1).

The source delivers key, value, headers, partition, offset and the broker's append time; an
Iterator pandas UDF decodes the envelope with fastavro (the schema is parsed once per Python worker
process, before the first batch of each partition). A record that cannot be decoded is kept as a
row with ``error`` set, so one bad record never fails a job (DLQ-4).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import pandas as pd
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F  # noqa: N812 - Spark's own idiom
from pyspark.sql.pandas.functions import pandas_udf
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    MapType,
    StringType,
    StructField,
    StructType,
)

from ordering_layer.envelope import HEADER_MESSAGE_ID, HEADER_PARTITION_COUNT, decode_record, parsed_schema

_LOGGER = logging.getLogger(__name__)

DECODED = StructType([
    StructField("ordering_key", StringType()),
    StructField("message_id", StringType()),
    StructField("partition_count", IntegerType()),
    StructField("attributes", MapType(StringType(), StringType())),
    StructField("data", BinaryType()),
    StructField("error", StringType()),
])

COLUMNS = ("topic", "ordering_key", "message_id", "sequence_number", "partition", "offset", "partition_count",
           "enqueued_time", "attributes", "data", "error")


def _lenient_text(raw: Any) -> str | None:
    if not isinstance(raw, bytes) or not raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _lenient_count(raw: Any) -> int | None:
    text = _lenient_text(raw)
    return int(text) if text is not None and text.isdigit() and int(text) > 0 else None


def decode_frame(keys: pd.Series, values: pd.Series, headers: pd.Series) -> pd.DataFrame:
    """Decode one Arrow batch of Kafka records into the ``DECODED`` columns.

    A record that ``decode_record`` refuses gets ``error`` (the reason), ``data`` = the raw value,
    and whatever can still be read: the key as text, message id and partition count headers.
    """
    out: dict[str, list[Any]] = {field.name: [] for field in DECODED.fields}
    for key, value, header_rows in zip(keys, values, headers, strict=True):
        pairs = [(h["key"], h["value"]) for h in header_rows] if header_rows is not None else []
        try:
            record = decode_record(key, value, pairs)
        except (ValueError, TypeError) as exc:  # EnvelopeError is a ValueError
            found = dict(pairs)
            out["ordering_key"].append(_lenient_text(key))
            out["message_id"].append(_lenient_text(found.get(HEADER_MESSAGE_ID)))
            out["partition_count"].append(_lenient_count(found.get(HEADER_PARTITION_COUNT)))
            out["attributes"].append(None)
            out["data"].append(value)
            out["error"].append(str(exc))
            continue
        out["ordering_key"].append(record.ordering_key)
        out["message_id"].append(record.message_id)
        out["partition_count"].append(record.partition_count)
        out["attributes"].append(record.attributes)
        out["data"].append(record.data)
        out["error"].append(None)
    frame = pd.DataFrame(out)
    frame["partition_count"] = frame["partition_count"].astype("Int32")
    return frame


def _decode_batches(batches: Iterator[tuple[pd.Series, pd.Series, pd.Series]]) -> Iterator[pd.DataFrame]:
    parsed_schema("envelope")  # once per worker process, before the partition's first batch
    for keys, values, headers in batches:
        yield decode_frame(keys, values, headers)


# Iterator pandas UDF: (key, value, headers) of Spark's Kafka source -> ``DECODED``. pyspark's
# stubs have no overload for an iterator UDF returning a struct.
decode_envelope = pandas_udf(_decode_batches, DECODED)  # type: ignore[call-overload]


def decoded(raw: DataFrame) -> DataFrame:
    """The layer's columns from a Kafka-source DataFrame (batch or streaming) read with headers."""
    message = decode_envelope(F.col("key"), F.col("value"), F.col("headers")).alias("m")
    sequence: Column = F.shiftleft(F.col("partition").cast("long"), 48).bitwiseOR(F.col("offset"))
    return (raw.select("topic", "partition", "offset", "timestamp", message)
            .select("topic", "m.ordering_key", "m.message_id", sequence.alias("sequence_number"), "partition",
                    "offset", "m.partition_count", F.col("timestamp").alias("enqueued_time"), "m.attributes",
                    "m.data", "m.error"))


def _source_options(topic: str, bootstrap: str, options: Mapping[str, str] | None) -> dict[str, str]:
    return {"kafka.bootstrap.servers": bootstrap, "subscribe": topic, "includeHeaders": "true",
            **(options or {})}


def read_ordered(spark: SparkSession, topic: str, bootstrap: str, *, starting_offsets: str = "earliest",
                 ending_offsets: str = "latest", options: Mapping[str, str] | None = None) -> DataFrame:
    """Read ``topic`` once with Spark's Kafka source and decode the envelope (SPK-1).

    Args:
        spark: a session with Spark's Kafka source on its class path (see ``local_session``).
        topic: the topic to read (all partitions).
        bootstrap: Kafka bootstrap servers.
        starting_offsets, ending_offsets: as the Kafka source's options (``earliest``/``latest`` or
            per-partition JSON).
        options: further Kafka source options (``kafka.*`` settings pass to the consumer).

    Returns:
        One row per record: ``topic``, ``ordering_key`` (null: unordered), ``message_id``,
        ``sequence_number`` (``partition << 48 | offset``), ``partition``, ``offset``,
        ``partition_count`` (from the header), ``enqueued_time`` (the broker's append time),
        ``attributes``, ``data``, and ``error`` (null when the record decoded; for an undecodable
        record the reason, with ``data`` holding the raw value). See ``undecodable``.
    """
    reader = spark.read.format("kafka").options(**_source_options(topic, bootstrap, options))
    raw = reader.option("startingOffsets", starting_offsets).option("endingOffsets", ending_offsets).load()
    return decoded(raw)


def read_ordered_stream(spark: SparkSession, topic: str, bootstrap: str, *, starting_offsets: str = "earliest",
                        max_offsets_per_trigger: int | None = None,
                        options: Mapping[str, str] | None = None) -> DataFrame:
    """Structured Streaming variant of ``read_ordered``: the same columns, as a streaming DataFrame.

    Args:
        max_offsets_per_trigger: cap on records per micro-batch (Kafka source ``maxOffsetsPerTrigger``).
        Others as ``read_ordered``.
    """
    reader = spark.readStream.format("kafka").options(**_source_options(topic, bootstrap, options))
    reader = reader.option("startingOffsets", starting_offsets)
    if max_offsets_per_trigger is not None:
        reader = reader.option("maxOffsetsPerTrigger", str(max_offsets_per_trigger))
    return decoded(reader.load())


def undecodable(df: DataFrame) -> DataFrame:
    """The records of a ``read_ordered`` DataFrame that could not be decoded, with the reason (DLQ-4).

    Columns: ``topic``, ``partition``, ``offset``, ``sequence_number``, ``enqueued_time``,
    ``ordering_key`` and ``message_id`` (when still readable), ``error``, and ``value`` (the raw
    record value).
    """
    return df.where(F.col("error").isNotNull()).select(
        "topic", "partition", "offset", "sequence_number", "enqueued_time", "ordering_key", "message_id",
        "error", F.col("data").alias("value"))
