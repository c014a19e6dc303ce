"""Ordered export of a topic to Parquet, the body of the ``spark/ordered_export.py`` job."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, NamedTuple

from pyspark import StorageLevel
from pyspark.sql import SparkSession
from pyspark.sql import functions as F  # noqa: N812 - Spark's own idiom

from ordering_layer.spark.reader import read_ordered
from ordering_layer.spark.restore import restore_order

_LOGGER = logging.getLogger(__name__)


class ExportSummary(NamedTuple):
    """What an export wrote.

    Attributes:
        messages: rows written (messages after duplicates were dropped).
        keys: ordering keys (distinct key bytes).
        unordered: messages without a key.
        duplicates: records dropped as repeated message ids.
        undefined_keys: keys whose order the data does not define (``order_undefined``, PUB-7).
        malformed_metadata: records whose ``ol-`` headers were ignored as malformed (DLQ-4).
    """

    messages: int
    keys: int
    unordered: int
    duplicates: int
    undefined_keys: int
    malformed_metadata: int


def export_ordered(spark: SparkSession, topic: str, bootstrap: str, out: str, *, files: int = 4,
                   partitions: int | None = None, mode: str = "errorifexists",
                   starting_offsets: str = "earliest", ending_offsets: str = "latest",
                   kafka_config: Mapping[str, Any] | None = None) -> ExportSummary:
    """Write ``topic`` to Parquet at ``out`` with one ordered sequence per ordering key.

    Every key's messages go to one of ``files`` files (by hash of the key's bytes), contiguous and
    sorted by ``key_sequence``; the columns are those of ``restore_order``. The topic is read once.

    Args:
        spark: a session with Spark's Kafka source (``local_session``).
        topic: the topic to read.
        bootstrap: Kafka bootstrap servers.
        out: the output folder.
        files: how many Parquet files (keys are hashed into them).
        partitions: passed to ``restore_order``.
        mode: Spark's save mode (``errorifexists`` or ``overwrite``).
        starting_offsets: where the Kafka source's range starts.
        ending_offsets: where the Kafka source's range ends.
        kafka_config: the layer's Kafka settings of a secured cluster (see ``read_ordered``).

    Raises:
        ValueError: ``files`` < 1.
    """
    if files < 1:
        raise ValueError(f"files must be >= 1, got {files}")
    records = read_ordered(spark, topic, bootstrap, starting_offsets=starting_offsets, ending_offsets=ending_offsets,
                           kafka_config=kafka_config).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        ordered = (restore_order(records, partitions=partitions)
                   .repartition(files, "key")
                   .sortWithinPartitions("key", "key_sequence"))
        ordered.write.mode(mode).parquet(out)
        read = records.agg(F.count(F.lit(1)).alias("records"),
                           F.count_if(F.col("malformed_metadata").isNotNull()).alias("malformed")).first()
    finally:
        records.unpersist()
    written = spark.read.parquet(out).agg(
        F.count(F.lit(1)).alias("messages"),
        F.count_distinct("key").alias("keys"),
        F.count_if(F.col("key").isNull()).alias("unordered"),
        F.count_distinct(F.when(F.col("order_undefined"), F.col("key"))).alias("undefined")).first()
    assert read is not None and written is not None  # an aggregate without grouping has one row
    summary = ExportSummary(written["messages"], written["keys"], written["unordered"],
                            read["records"] - written["messages"], written["undefined"], read["malformed"])
    _LOGGER.info("exported %s to %s: %s", topic, out, summary)
    return summary
