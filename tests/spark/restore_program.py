"""A program as a user submits one to a cluster: a topic read in restored per-key order, batch and streaming.

``tests/spark/test_spark_cluster.py`` runs it with ``spark-submit --master spark://...`` (so it takes
its session from spark-submit and imports nothing from ``tests``); it writes what it got to a JSON
file: the master it ran on, the rows of ``restore_order`` and those of ``restore_order_stream`` (an
``availableNow`` run) with the micro-batch that emitted each.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, Row, SparkSession

from ordering_layer.config import read_kafka_properties
from ordering_layer.spark import read_ordered, read_ordered_stream, restore_order, restore_order_stream

FIELDS = ("key_sequence", "message_id", "partition", "offset", "order_undefined")


def as_json(row: Row) -> dict[str, Any]:
    """The fields that show a row's restored place (the key as hex: it may not be UTF-8)."""
    return {"key": row.key.hex() if row.key is not None else None, **{name: row[name] for name in FIELDS}}


def main(argv: list[str] | None = None) -> int:
    """Read, restore, write the JSON file; return the exit code."""
    parser = argparse.ArgumentParser(prog="restore_program.py")
    parser.add_argument("--topic", required=True)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--kafka-config", help="properties file of further Kafka client settings")
    parser.add_argument("--checkpoint", required=True, help="the streaming query's checkpoint folder")
    parser.add_argument("--out", required=True, help="the JSON file to write")
    args = parser.parse_args(argv)
    kafka_config = read_kafka_properties(Path(args.kafka_config)) if args.kafka_config else None

    spark = SparkSession.builder.appName("restore-order").getOrCreate()
    streamed: list[dict[str, Any]] = []

    def collect(batch: DataFrame, batch_id: int) -> None:
        streamed.extend({**as_json(row), "batch_id": batch_id} for row in batch.collect())

    try:
        restored = restore_order(read_ordered(spark, args.topic, args.bootstrap, kafka_config=kafka_config))
        batch = [as_json(row) for row in restored.collect()]
        stream = restore_order_stream(read_ordered_stream(spark, args.topic, args.bootstrap,
                                                          max_offsets_per_trigger=40, kafka_config=kafka_config))
        query = (stream.writeStream.outputMode("append").foreachBatch(collect)
                 .option("checkpointLocation", args.checkpoint).trigger(availableNow=True).start())
        query.awaitTermination()
        master = spark.sparkContext.master
    finally:
        spark.stop()
    Path(args.out).write_text(json.dumps({"master": master, "batch": batch, "stream": streamed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
