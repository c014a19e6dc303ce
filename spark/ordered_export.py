"""Ordered export of a topic to Parquet: one ordered sequence per ordering key (SPK-1, SPK-2).

Reads the topic with Spark's Kafka source (every record is a message, whoever wrote it: key =
ordering key, value = payload, headers = attributes), restores each key's order (deduplicated,
numbered; a key whose order the records do not define is flagged ``order_undefined``, PUB-7) and
writes Parquet in which every key's messages lie in one file, contiguous and sorted by
``key_sequence`` (the shape of Pub/Sub's ordered exports).

Run it with python (a ``local[2]`` session, or one on the cluster that ``--master`` or
``$ORDERING_LAYER_SPARK_MASTER`` names, with the Kafka source jars fetched by Maven):

    python spark/ordered_export.py --topic orders --out /tmp/orders-parquet

or with spark-submit, on a cluster (``--master spark://host:7077``; ``ordering-layer stack up
--spark-cluster`` starts one here) or locally, passing the same jars (shipped to the executors) and
a Python that has ``ordering_layer`` installed (the executors run it: on a cluster, at that path on
every worker; ``--out`` must then be storage that every executor writes to and the driver reads):

    PYSPARK_PYTHON=$PWD/.venv/bin/python .venv/bin/spark-submit --master "$ORDERING_LAYER_SPARK_MASTER" \\
        --jars "$(.venv/bin/python spark/ordered_export.py --print-jars)" \\
        --conf spark.sql.shuffle.partitions=8 \\
        spark/ordered_export.py --topic orders --out /tmp/orders-parquet
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

_LOGGER = logging.getLogger("ordered_export")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The job's command line."""
    parser = argparse.ArgumentParser(
        prog="ordered_export.py",
        description="Export a topic to Parquet with one ordered, deduplicated sequence per ordering key.")
    parser.add_argument("--topic", help="topic to export")
    parser.add_argument("--out", help="output folder (Parquet)")
    parser.add_argument("--bootstrap", default=os.environ.get("ORDERING_LAYER_BOOTSTRAP"),
                        help="Kafka bootstrap servers (default: $ORDERING_LAYER_BOOTSTRAP)")
    parser.add_argument("--kafka-config", default=os.environ.get("ORDERING_LAYER_KAFKA_CONFIG"),
                        help="properties file of further Kafka client settings, e.g. of a secured cluster "
                             "(default: $ORDERING_LAYER_KAFKA_CONFIG)")
    parser.add_argument("--starting-offsets", default="earliest",
                        help="Kafka source startingOffsets: earliest, latest or per-partition JSON (default: earliest)")
    parser.add_argument("--ending-offsets", default="latest",
                        help="Kafka source endingOffsets: latest or per-partition JSON (default: latest)")
    parser.add_argument("--files", type=int, default=4,
                        help="number of output files; keys are hashed into them (default: 4)")
    parser.add_argument("--partitions", type=int,
                        help="partitions the keys are hashed into (default: spark.sql.shuffle.partitions)")
    parser.add_argument("--mode", choices=("errorifexists", "overwrite"), default="errorifexists",
                        help="what to do when --out exists (default: errorifexists)")
    parser.add_argument("--master", default=os.environ.get("ORDERING_LAYER_SPARK_MASTER", "local[2]"),
                        help="Spark master when run with python (default: $ORDERING_LAYER_SPARK_MASTER, else "
                             "local[2]; spark-submit's own --master wins)")
    parser.add_argument("--print-jars", action="store_true",
                        help="print the Kafka source jars as a comma-separated list (for spark-submit --jars) and exit")
    args = parser.parse_args(argv)
    if not args.print_jars:
        missing = [name for name in ("topic", "out", "bootstrap") if not getattr(args, name)]
        if missing:
            parser.error("the following arguments are required: " + ", ".join(f"--{name}" for name in missing))
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the export; return the process exit code."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.print_jars:
        from ordering_layer.stack.jars import spark_kafka_jars

        print(",".join(str(path) for path in spark_kafka_jars()))
        return 0

    from pyspark.sql import SparkSession

    from ordering_layer.config import read_kafka_properties
    from ordering_layer.spark import local_session
    from ordering_layer.spark.export import export_ordered

    kafka_config = read_kafka_properties(Path(args.kafka_config)) if args.kafka_config else None
    active = SparkSession.getActiveSession()
    if active is not None:  # called from a program that has its session already
        spark = active
    elif os.environ.get("PYSPARK_GATEWAY_PORT"):  # under spark-submit: its --master and --jars apply
        spark = SparkSession.builder.appName("ordered-export").getOrCreate()
    else:
        spark = local_session("ordered-export", master=args.master)
    try:
        start = time.perf_counter()
        summary = export_ordered(spark, args.topic, args.bootstrap, args.out, files=args.files,
                                 partitions=args.partitions, mode=args.mode,
                                 starting_offsets=args.starting_offsets, ending_offsets=args.ending_offsets,
                                 kafka_config=kafka_config)
        elapsed = time.perf_counter() - start
    finally:
        if active is None:
            spark.stop()
    print(f"exported {args.topic} to {args.out} in {elapsed:.1f} s: {summary.messages} messages "
          f"({summary.keys} ordering keys, {summary.unordered} unordered), {summary.duplicates} duplicates "
          f"dropped, {summary.undefined_keys} keys without a defined order, {summary.malformed_metadata} "
          "records with malformed ol- headers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
