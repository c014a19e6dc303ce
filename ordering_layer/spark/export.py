"""Ordered export of a topic to Parquet, the body of the ``spark/ordered_export.py`` job."""

from __future__ import annotations

import logging
from typing import NamedTuple

from pyspark import StorageLevel
from pyspark.sql import SparkSession
from pyspark.sql import functions as F  # noqa: N812 - Spark's own idiom

from ordering_layer.spark.reader import read_ordered, undecodable
from ordering_layer.spark.restore import restore_order

_LOGGER = logging.getLogger(__name__)


class ExportSummary(NamedTuple):
    """What an export wrote."""

    messages: int
    keys: int
    unordered: int
    duplicates: int
    gaps: int
    undecodable: int


def export_ordered(spark: SparkSession, topic: str, bootstrap: str, out: str, *, files: int = 4,
                   partitions: int | None = None, mode: str = "errorifexists",
                   starting_offsets: str = "earliest", ending_offsets: str = "latest",
                   undecodable_out: str | None = None) -> ExportSummary:
    """Write ``topic`` to Parquet at ``out`` with one ordered sequence per ordering key.

    Every key's messages go to one of ``files`` files (by hash of the key), contiguous and sorted
    by ``key_sequence``; the columns are those of ``restore_order``. The topic is read once.

    Args:
        spark: a session with Spark's Kafka source (``local_session``).
        topic, bootstrap: what to read.
        out: the output folder.
        files: how many Parquet files (keys are hashed into them).
        partitions: passed to ``restore_order``.
        mode: Spark's save mode (``errorifexists`` or ``overwrite``).
        starting_offsets, ending_offsets: the Kafka source's range.
        undecodable_out: where to write undecodable records too (Parquet), if given.

    Raises:
        ValueError: ``files`` < 1.
    """
    if files < 1:
        raise ValueError(f"files must be >= 1, got {files}")
    records = read_ordered(spark, topic, bootstrap, starting_offsets=starting_offsets,
                           ending_offsets=ending_offsets).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        ordered = (restore_order(records, partitions=partitions)
                   .repartition(files, "ordering_key")
                   .sortWithinPartitions("ordering_key", "key_sequence"))
        ordered.write.mode(mode).parquet(out)
        bad = undecodable(records)
        if undecodable_out:
            bad.write.mode(mode).parquet(undecodable_out)
        decodable = records.where(F.col("error").isNull()).count()
        broken = bad.count()
    finally:
        records.unpersist()
    written = spark.read.parquet(out).agg(
        F.count(F.lit(1)).alias("messages"),
        F.count_distinct("ordering_key").alias("keys"),
        F.count_if(F.col("ordering_key").isNull()).alias("unordered"),
        F.count_if("gap").alias("gaps")).first()
    assert written is not None
    summary = ExportSummary(written["messages"], written["keys"], written["unordered"],
                            decodable - written["messages"], written["gaps"], broken)
    _LOGGER.info("exported %s to %s: %s", topic, out, summary)
    return summary
