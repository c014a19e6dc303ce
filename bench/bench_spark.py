"""Spark: ``read_ordered + restore_order`` vs the plain ``read_ordered`` (issues 5 and 10).

For 10, 1,000 and 100,000 ordering keys, the same 100-byte messages (100,000 by default) are
published into one 4-partition topic per key count. Then, in one local[2] session, two jobs read
each topic completely and write to Spark's ``noop`` sink, which evaluates every column:

- plain: ``read_ordered`` (Spark's Kafka source with headers; payload, attributes, message id and
  partition count taken from the plain record by Spark SQL expressions);
- restore: the same read followed by ``restore_order`` (hash-partition and sort by key in the
  JVM, then per-key sequence order, dedup and numbering in the Python workers, per Arrow batch).

Runs alternate (plain, restore, plain, restore, ...) after a warm-up, and the best of each is
reported, to damp noise on a 2-core machine. The ratio is restore rows/s over plain rows/s: the
goal is >= 0.5 (restoring costs no more than the read itself).

    .venv/bin/python bench/bench_spark.py [--messages 100000] [--rounds 2] [--record bench/RESULTS.md]

A stack is started for the run unless ``ORDERING_LAYER_BOOTSTRAP`` and ``ORDERING_LAYER_REDIS_URL``
name one.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pyspark.sql import DataFrame, SparkSession

from bench.common import bench_stack
from ordering_layer import Admin, OrderedProducer
from ordering_layer.spark import local_session, read_ordered, restore_order

_LOGGER = logging.getLogger("bench_spark")

KEY_COUNTS = (10, 1_000, 100_000)
PARTITIONS = 4
HEADING = "## Spark: restore_order vs plain read (issue 5)"


def publish(bootstrap: str, keys: int, messages: int) -> str:
    """A new topic holding ``messages`` 100-byte messages round-robin over ``keys`` keys."""
    topic = f"bench-spark-{keys}-{uuid.uuid4().hex[:6]}"
    Admin({"bootstrap.servers": bootstrap}).create_topic(topic, partitions=PARTITIONS)
    payload = b"x" * 100
    names = [f"key-{i}" for i in range(keys)]
    with OrderedProducer({"bootstrap.servers": bootstrap}) as producer:
        futures = [producer.publish(topic, payload, ordering_key=names[n % keys]) for n in range(messages)]
        producer.flush()
    assert all(f.exception() is None for f in futures)
    return topic


def timed(job: Callable[[], DataFrame], rows: int) -> float:
    """Rows per second of running ``job()`` to the noop sink (every column evaluated)."""
    start = time.perf_counter()
    job().write.format("noop").mode("overwrite").save()
    return rows / (time.perf_counter() - start)


def measure(spark: SparkSession, bootstrap: str, topic: str, messages: int, rounds: int) -> tuple[float, float]:
    """Best plain and best restore rows/s over ``rounds`` alternating runs."""
    def plain() -> DataFrame:
        return read_ordered(spark, topic, bootstrap)

    def restore() -> DataFrame:
        return restore_order(read_ordered(spark, topic, bootstrap))

    best_plain = best_restore = 0.0
    for _ in range(rounds):
        best_plain = max(best_plain, timed(plain, messages))
        best_restore = max(best_restore, timed(restore, messages))
    return best_plain, best_restore


def table(messages: int, rows: list[tuple[int, float, float]]) -> list[str]:
    """The result table, Markdown."""
    lines = ["| keys | messages | plain read_ordered (rows/s) | read + restore_order (rows/s) | ratio |",
             "|---:|---:|---:|---:|---:|"]
    lines += [f"| {keys:,} | {messages:,} | {plain:,.0f} | {restore:,.0f} | {restore / plain:.2f} |"
              for keys, plain, restore in rows]
    return lines


def record(path: Path, command: str, lines: list[str], spark_version: str) -> None:
    """Replace (or add) this benchmark's section of ``path``, leaving other sections alone."""
    prose = (f"`{command}` ({time.strftime('%Y-%m-%d')}, Spark {spark_version} local[2], driver 1g, "
             f"4 shuffle partitions, {PARTITIONS} Kafka partitions, 100-byte messages; 2-core machine, best of "
             "alternating runs). Both jobs read the whole topic with Spark's Kafka source and take payload, "
             "attributes and layer metadata from the plain records with Spark SQL expressions; `restore` adds "
             "`restore_order` (hash-partition and sort by key bytes in the JVM, then per-key sequence order, "
             "dedup and numbering per Arrow batch in Python). "
             "Ratio = restore rows/s / plain rows/s; the goal is >= 0.5.")
    section = "\n".join([HEADING, "", textwrap.fill(prose, width=100, break_on_hyphens=False), "", *lines, ""])
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    pattern = re.compile(rf"^{re.escape(HEADING)}\n.*?(?=^## |\Z)", re.DOTALL | re.MULTILINE)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text.rstrip("\n") + "\n")


def main() -> None:
    """Run the benchmark and print the table (and record it when asked)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=100_000, help="messages per topic (default 100,000)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs of each job (default 2)")
    parser.add_argument("--record", type=Path, help="write the table into this RESULTS.md section")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    command = "python " + " ".join(["bench/bench_spark.py", *sys.argv[1:]])

    with bench_stack() as endpoints:
        topics = {}
        for keys in KEY_COUNTS:
            start = time.perf_counter()
            topics[keys] = publish(endpoints.bootstrap, keys, args.messages)
            print(f"published {args.messages:,} messages over {keys:,} keys in {time.perf_counter() - start:.1f} s",
                  flush=True)
        spark = local_session("bench-spark")
        try:
            # Warm-up: Python workers, JIT, Kafka consumers.
            restore_order(read_ordered(spark, topics[KEY_COUNTS[0]], endpoints.bootstrap)).write.format(
                "noop").mode("overwrite").save()
            rows = []
            for keys in KEY_COUNTS:
                plain, restore = measure(spark, endpoints.bootstrap, topics[keys], args.messages, args.rounds)
                print(f"{keys:>7,} keys: plain {plain:>9,.0f} rows/s   restore {restore:>9,.0f} rows/s   "
                      f"ratio {restore / plain:.2f}", flush=True)
                rows.append((keys, plain, restore))
            version = spark.version
        finally:
            spark.stop()
    lines = table(args.messages, rows)
    print("\n".join(lines))
    if args.record:
        record(args.record, command, lines, version)
        print(f"recorded in {args.record}")


if __name__ == "__main__":
    main()
