"""The Spark step of the demo (``make demo``): read what the demo published and restore per-key order."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pyspark.sql import SparkSession
from pyspark.sql import functions as F  # noqa: N812 - Spark's own idiom

from ordering_layer.spark.reader import read_ordered
from ordering_layer.spark.restore import restore_order
from ordering_layer.spark.session import local_session
from ordering_layer.stack import Endpoints

_LOGGER = logging.getLogger(__name__)


def demo_step(endpoints: Endpoints, topic: str, *, out: Callable[[str], None] = print,
              spark: SparkSession | None = None, number_attribute: str = "n", sample_keys: int = 4) -> bool:
    """Read ``topic`` with Spark's Kafka source, restore per-key order, print it and check it.

    Checks, per key: ``key_sequence`` runs 1..n, message ids are unique, the order is defined (no
    ``order_undefined``: every record was published through the layer), and where every message
    carries the attribute ``number_attribute`` (the demo numbers each key's messages from 0 in
    publish order), the restored order is exactly that numbering.

    Args:
        endpoints: the stack the demo published to.
        topic: the demo's topic.
        out: where the lines go.
        spark: a session to use; by default a ``local_session`` is started and stopped here.
        number_attribute: the attribute holding each message's per-key publish number.
        sample_keys: how many keys to print in full-order samples.

    Returns:
        True when every check held.
    """
    own_session = spark is None
    session = spark or local_session("ordering-layer-demo")
    version = session.version
    try:
        start = time.perf_counter()
        messages = read_ordered(session, topic, endpoints.bootstrap).cache()
        restored = restore_order(messages)
        per_key = (restored.where(F.col("key").isNotNull())
                   .groupBy("key")
                   .agg(F.first("ordering_key").alias("ordering_key"), F.sort_array(F.collect_list(F.struct(
                       "key_sequence", "message_id", "partition", "offset", "order_undefined",
                       F.col("attributes")[number_attribute].cast("long").alias("number")))).alias("rows"))
                   .collect())
        counts = messages.agg(
            F.count_if(F.col("malformed_metadata").isNotNull()).alias("malformed"),
            F.count_if(F.col("partition_count").isNotNull()).alias("stamped"),
            F.count_if(F.col("key").isNotNull()).alias("keyed"),
            F.count_if(F.col("key").isNull()).alias("unordered")).first()
        assert counts is not None  # an aggregate without grouping has one row
        elapsed = time.perf_counter() - start
        messages.unpersist()
    finally:
        if own_session:
            session.stop()

    delivered = sum(len(row["rows"]) for row in per_key)
    out(f"== Spark {version}: {topic} read with Spark's Kafka source, order restored per key "
        f"in {elapsed:.1f} s")
    out(f"{counts['keyed']} keyed and {counts['unordered']} unordered records, {counts['stamped']} with the "
        f"ol-partition-count header, {counts['malformed']} with malformed ol- headers; {len(per_key)} ordering "
        f"keys, {delivered} keyed messages after dropping {counts['keyed'] - delivered} duplicates")
    numbered = contiguous = unique = 0
    undefined = 0
    for row in per_key:
        rows = row["rows"]
        contiguous += [r["key_sequence"] for r in rows] == list(range(1, len(rows) + 1))
        unique += len({r["message_id"] for r in rows}) == len(rows)
        undefined += any(r["order_undefined"] for r in rows)
        numbers = [r["number"] for r in rows]
        numbered += None not in numbers and numbers == list(range(len(rows)))
    for row in sorted(per_key, key=lambda r: r["ordering_key"])[:sample_keys]:
        shown = "  ".join(f"{r['key_sequence']}:#{r['number']}(p{r['partition']}:{r['offset']})"
                          for r in row["rows"][:5])
        out(f"  {row['ordering_key']:<14} {shown} ...")
    keys = len(per_key)
    checks = [
        (f"SPK-2 key_sequence runs 1..n: {contiguous}/{keys} keys", contiguous == keys),
        (f"SPK-2 one row per message id: {unique}/{keys} keys", unique == keys),
        (f"SPK-2 restored order = publish order ('{number_attribute}' attribute): {numbered}/{keys} keys",
         numbered == keys),
        (f"SPK-2 every key's order defined by its records: {keys - undefined}/{keys} keys", undefined == 0),
    ]
    for text, ok in checks:
        out(f"[{'ok' if ok else 'FAILED'}] {text}")
    return all(ok for _, ok in checks)

