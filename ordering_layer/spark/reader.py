"""Reading topics with Spark's own Kafka source, batch and streaming (SPK-1, PUB-6, PUB-7).

A message is a plain Kafka record (``ordering_layer.record``), so reading needs no decoding: the
payload is the record's value, the attributes are its headers, and the layer's ``ol-`` headers
give the partition count at publish and, where one was given, the message id. Every record of the
topic is a message, whoever wrote it. The columns are computed with Spark SQL expressions on the
source's ``key``, ``value`` and ``headers`` columns (no Python worker), by the rules of
``ordering_layer.record`` (``read_metadata``, ``attributes_of``, ``display_key``; the unit tests
hold the two to agreement). The expressions run in the JVM at about the source's own speed, where a
Python worker costs a round trip per Arrow batch (measured: a pandas UDF for the key's text form
alone cost about a fifth of the read).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F  # noqa: N812 - Spark's own idiom

from ordering_layer.record import (
    HEADER_MESSAGE_ID,
    HEADER_PARTITION_COUNT,
    MAX_MESSAGE_ID_BYTES,
    RESERVED_PREFIX,
)
from ordering_layer.spark.security import kafka_source_options, set_source_options

_LOGGER = logging.getLogger(__name__)

COLUMNS = ("topic", "key", "ordering_key", "message_id", "sequence_number", "partition", "offset",
           "partition_count", "enqueued_time", "attributes", "data", "malformed_metadata")


def _utf8(value: Column) -> Column:
    """True where the binary ``value`` is valid UTF-8 (a binary-to-string cast keeps the bytes)."""
    return F.is_valid_utf8(value.cast("string"))


def _valid_count(value: Column) -> Column:
    """``record``'s rule for ``ol-partition-count``: 1..19 decimal digits, a positive number (one
    above a long's range, which ``record`` would take, is ignored here as malformed)."""
    text = value.cast("string")
    return value.isNotNull() & text.rlike("^[0-9]{1,19}$") & (text.try_cast("long") > 0)


def _valid_id(value: Column) -> Column:
    """``record``'s rule for ``ol-message-id``: 1..256 bytes of UTF-8."""
    return value.isNotNull() & F.length(value).between(1, MAX_MESSAGE_ID_BYTES) & _utf8(value)


def _valid_headers(headers: Column, name: str, valid: Callable[[Column], Column]) -> Column:
    """The headers named ``name`` whose value is ``valid``, in record order."""
    return F.filter(headers, lambda header: (header["key"] == name) & valid(header["value"]))


def _byte(key_bytes: Column, index: Column) -> Column:
    """The byte at ``index`` (0-based) of an array of byte values; -1 past the end."""
    return F.coalesce(F.get(key_bytes, index), F.lit(-1))


def _sequence_length(key_bytes: Column, at: Column) -> Column:
    """Length of the well-formed UTF-8 sequence starting at ``at`` (the Unicode table of
    well-formed byte sequences, which Python's strict decoder follows); 0 when there is none."""
    b0, b1, b2, b3 = (_byte(key_bytes, at + k) for k in range(4))

    def cont(b: Column) -> Column:
        return b.between(0x80, 0xBF)

    three = (((b0 == 0xE0) & b1.between(0xA0, 0xBF)) | ((b0 == 0xED) & b1.between(0x80, 0x9F))
             | ((b0.between(0xE1, 0xEC) | b0.between(0xEE, 0xEF)) & cont(b1))) & cont(b2)
    four = (((b0 == 0xF0) & b1.between(0x90, 0xBF)) | ((b0 == 0xF4) & b1.between(0x80, 0x8F))
            | (b0.between(0xF1, 0xF3) & cont(b1))) & cont(b2) & cont(b3)
    return (F.when(b0.between(0, 0x7F), 1).when(b0.between(0xC2, 0xDF) & cont(b1), 2).when(three, 3)
            .when(four, 4).otherwise(0))


def _escaped(key: Column) -> Column:
    """``key.decode("utf-8", "backslashreplace")`` as a Spark expression: well-formed sequences
    decoded, every other byte as ``\\xNN``."""
    key_bytes = F.transform(F.sequence(F.lit(1), F.length(key)),
                            lambda i: F.conv(F.hex(key.substr(i, F.lit(1))), 16, 10).cast("int"))

    def step(state: Column, at: Column) -> Column:
        length = _sequence_length(key_bytes, at)
        text = (F.when(length > 0, F.decode(key.substr(at + 1, length), "UTF-8"))
                .otherwise(F.concat(F.lit("\\x"), F.lower(F.hex(key.substr(at + 1, F.lit(1)))))))
        return F.when(at < state["next"], state).otherwise(F.struct(
            (at + F.greatest(length, F.lit(1))).alias("next"), F.concat(state["text"], text).alias("text")))

    start = F.struct(F.lit(0).alias("next"), F.lit("").alias("text"))
    return F.aggregate(F.sequence(F.lit(0), F.length(key) - 1), start, step, lambda state: state["text"])


def _ordering_key(key: Column) -> Column:
    """The ordering key as text (null: unordered), as ``record.display_key`` shows it. The escaping
    runs only for the rare keys that are not UTF-8 (``CASE WHEN`` evaluates lazily)."""
    return F.when(key.isNull(), None).when(_utf8(key), key.cast("string")).otherwise(_escaped(key))


def _attributes(headers: Column) -> Column:
    """``record.attributes_of``: headers outside ``ol-`` with UTF-8 values; a repeated name keeps its
    last value."""
    kept = F.filter(headers, lambda h: ~h["key"].startswith(RESERVED_PREFIX) & h["value"].isNotNull()
                    & _utf8(h["value"]))
    last = F.filter(kept, lambda h, i: ~F.exists(F.slice(kept, i + 2, F.greatest(F.size(kept), F.lit(1))),
                                                  lambda later: later["key"] == h["key"]))
    return F.map_from_entries(F.transform(last, lambda h: F.struct(h["key"].alias("key"),
                                                                   h["value"].cast("string").alias("value"))))


def _malformed(headers: Column) -> Column:
    """The names of the ``ol-`` headers ignored as malformed, comma-separated; null when none."""
    ignored = F.filter(headers, lambda h: ((h["key"] == HEADER_PARTITION_COUNT) & ~_valid_count(h["value"]))
                       | ((h["key"] == HEADER_MESSAGE_ID) & ~_valid_id(h["value"])))
    return F.when(F.size(ignored) > 0, F.array_join(F.transform(ignored, lambda h: h["key"]), ","))


def messages(raw: DataFrame) -> DataFrame:
    """The layer's columns (``COLUMNS``) from a Kafka-source DataFrame (batch or streaming) read with
    headers.

    ``key`` is the record key (null where absent or empty: unordered), the exact bytes order
    restoring groups by; ``ordering_key`` is its text form. ``message_id`` is the ``ol-message-id``
    header or else the decimal sequence number; ``partition_count`` the ``ol-partition-count``
    header (null: not published through the layer); ``data`` the value byte for byte (a null value
    is an empty payload); ``malformed_metadata`` names the ``ol-`` headers ignored as malformed
    (the record is then read as a plain record, DLQ-4).
    """
    headers = F.coalesce(F.col("headers"), F.array())
    key = F.when(F.length("key") > 0, F.col("key"))
    sequence = F.shiftleft(F.col("partition").cast("long"), 48).bitwiseOR(F.col("offset"))
    # The last valid header wins, as in ``record.read_metadata``.
    message_id = F.try_element_at(_valid_headers(headers, HEADER_MESSAGE_ID, _valid_id), F.lit(-1))["value"]
    count = F.try_element_at(_valid_headers(headers, HEADER_PARTITION_COUNT, _valid_count), F.lit(-1))["value"]
    return raw.select(
        "topic", key.alias("key"), _ordering_key(key).alias("ordering_key"),
        F.coalesce(message_id.cast("string"), sequence.cast("string")).alias("message_id"),
        sequence.alias("sequence_number"), "partition", "offset",
        count.cast("string").cast("long").alias("partition_count"),
        F.col("timestamp").alias("enqueued_time"), _attributes(headers).alias("attributes"),
        F.coalesce(F.col("value"), F.lit(b"")).alias("data"), _malformed(headers).alias("malformed_metadata"))


def _source_options(topic: str, bootstrap: str, options: Mapping[str, str] | None,
                    kafka_config: Mapping[str, Any] | None) -> dict[str, str]:
    return {"kafka.bootstrap.servers": bootstrap, "subscribe": topic, "includeHeaders": "true",
            **kafka_source_options(kafka_config or {}), **(options or {})}


def read_ordered(spark: SparkSession, topic: str, bootstrap: str, *, starting_offsets: str = "earliest",
                 ending_offsets: str = "latest", options: Mapping[str, str] | None = None,
                 kafka_config: Mapping[str, Any] | None = None) -> DataFrame:
    """Read ``topic`` once with Spark's Kafka source: one row per record, of any producer (SPK-1).

    Args:
        spark: a session with Spark's Kafka source on its class path (see ``local_session``).
        topic: the topic to read (all partitions).
        bootstrap: Kafka bootstrap servers.
        starting_offsets: as the Kafka source's option (``earliest``/``latest`` or per-partition JSON).
        ending_offsets: as the Kafka source's option (``earliest``/``latest`` or per-partition JSON).
        options: further Kafka source options (``kafka.*`` settings pass to the consumer).
        kafka_config: the layer's confluent-kafka settings of a secured cluster (``security.protocol``,
            ``sasl.*``, ``ssl.ca.location``), translated to the source's (``security.kafka_source_options``);
            ``options`` override them.

    Returns:
        The ``COLUMNS``: ``topic``, ``key`` (the ordering key's bytes; null: unordered),
        ``ordering_key`` (its text, non-UTF-8 bytes as ``\\xNN``), ``message_id``,
        ``sequence_number`` (``partition << 48 | offset``), ``partition``, ``offset``,
        ``partition_count`` (null without the header), ``enqueued_time`` (the broker's append
        time), ``attributes``, ``data`` and ``malformed_metadata`` (see ``messages``).
    """
    reader = set_source_options(spark.read.format("kafka"), _source_options(topic, bootstrap, options, kafka_config))
    raw = reader.option("startingOffsets", starting_offsets).option("endingOffsets", ending_offsets).load()
    return messages(raw)


def read_ordered_stream(spark: SparkSession, topic: str, bootstrap: str, *, starting_offsets: str = "earliest",
                        max_offsets_per_trigger: int | None = None, options: Mapping[str, str] | None = None,
                        kafka_config: Mapping[str, Any] | None = None) -> DataFrame:
    """Structured Streaming variant of ``read_ordered``: the same columns, as a streaming DataFrame.

    Args:
        spark: as ``read_ordered`` takes it.
        topic: as ``read_ordered`` takes it.
        bootstrap: as ``read_ordered`` takes it.
        starting_offsets: as ``read_ordered`` takes it.
        max_offsets_per_trigger: cap on records per micro-batch (Kafka source ``maxOffsetsPerTrigger``).
        options: as ``read_ordered`` takes it.
        kafka_config: as ``read_ordered`` takes it.
    """
    reader = set_source_options(spark.readStream.format("kafka"),
                                _source_options(topic, bootstrap, options, kafka_config))
    reader = reader.option("startingOffsets", starting_offsets)
    if max_offsets_per_trigger is not None:
        reader = reader.option("maxOffsetsPerTrigger", str(max_offsets_per_trigger))
    return messages(reader.load())
