"""Structured Streaming order restoring against the real broker: SPK-1 (streaming reader), SPK-3, PUB-7."""

from __future__ import annotations

import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, Row, SparkSession

from ordering_layer import Admin
from ordering_layer.spark import read_ordered_stream, restore_order_stream
from tests.spark.workload import Workload

pytestmark = [pytest.mark.spark, pytest.mark.integration]

PLAIN = b"plain-a"
SPLIT = b"plain-split"


class _Sink:
    """Collects every micro-batch's output rows with the batch id (a ``foreachBatch`` sink)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, Row]] = []
        self.batches: set[int] = set()  # the micro-batches that emitted something

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        rows = batch.collect()
        if rows:
            self.batches.add(batch_id)
        self.rows.extend((batch_id, row) for row in rows)


def test_stream_restores_order_across_micro_batches(spark: SparkSession, kafka_config: dict[str, Any],
                                                    admin: Admin, tmp_path: Path) -> None:
    """SPK-3 / PUB-7: over many micro-batches and three runs of the query from one checkpoint, with
    data published between runs (duplicates, a partition count raised mid-way, records of a plain
    producer), each message is emitted exactly once and each key's messages are emitted in publish
    order, numbered on across micro-batches; a plain producer's key goes on by offset in its
    partition, and the key that a plain producer later writes into a second partition is flagged
    from then on."""
    topic = f"spark-stream-{uuid.uuid4().hex[:8]}"
    admin.create_topic(topic, partitions=3)
    bootstrap = kafka_config["bootstrap.servers"]
    work = Workload(kafka_config, admin, topic, keys=12, partitions=3)
    sink = _Sink()

    def run_query() -> None:
        stream = read_ordered_stream(spark, topic, bootstrap, max_offsets_per_trigger=60)
        query = (restore_order_stream(stream).writeStream.outputMode("append").foreachBatch(sink)
                 .option("checkpointLocation", str(tmp_path / "checkpoint"))
                 .trigger(availableNow=True).start())
        assert query.awaitTermination(180), "the availableNow run did not finish"
        assert query.exception() is None

    try:
        work.publish_rounds(5)
        work.publish_unordered(5)
        work.produce_plain(PLAIN, 3, partition=0)
        work.produce_plain(SPLIT, 2, partition=0)
        run_query()
        runs = [len(sink.batches)]
        work.republish(every=3, partitioner="murmur2_random")
        work.publish_rounds(2)
        work.produce_plain(PLAIN, 2, partition=0)
        work.produce_plain(None, 2, partition=1)
        work.publish_rounds(1)
        work.republish(every=2, partitioner="consistent_random", keyed=False)
        run_query()
        runs.append(len(sink.batches))
        work.raise_partitions(5)
        work.publish_rounds(2)
        split_later = work.produce_plain(SPLIT, 2, partition=1)
        work.produce_plain(PLAIN, 1, partition=0)
        work.publish_rounds(1)
        work.republish(every=4, partitioner="consistent_random")
        work.publish_rounds(1)
        run_query()
        runs.append(len(sink.batches))
    finally:
        work.close()

    assert runs[0] >= 2 and runs[1] > runs[0] and runs[2] > runs[1], runs
    emitted = [row.message_id for _, row in sink.rows]
    assert len(emitted) == len(set(emitted)), "a message was emitted twice"

    per_key: dict[bytes, list[tuple[int, Row]]] = defaultdict(list)
    for batch_id, row in sink.rows:
        if row.key is not None:
            per_key[bytes(row.key)].append((batch_id, row))
    assert set(per_key) == set(work.truth)
    for key, rows in per_key.items():
        rows.sort(key=lambda pair: pair[1].key_sequence)
        assert [row.key_sequence for _, row in rows] == list(range(1, len(rows) + 1)), key
        if key == SPLIT:
            continue
        assert [row.message_id for _, row in rows] == work.truth[key], key
        batch_ids = [batch_id for batch_id, _ in rows]
        assert batch_ids == sorted(batch_ids), f"{key!r} emitted out of order across micro-batches"
        assert len(set(batch_ids)) > 1, f"{key!r} was not spread over micro-batches"
        assert not any(row.late or row.order_undefined for _, row in rows), key
    split = per_key[SPLIT]
    assert sorted(row.message_id for _, row in split) == sorted(work.truth[SPLIT])
    assert {row.message_id for _, row in split if row.order_undefined} == set(split_later)
    unordered = [row for _, row in sink.rows if row.key is None]
    assert sorted(row.message_id for row in unordered) == sorted(work.unordered)
