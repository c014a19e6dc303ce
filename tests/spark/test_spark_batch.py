"""Spark batch reading and order restoring against the real broker: SPK-1, SPK-2, DLQ-4."""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
from pyspark.sql import Row, SparkSession

from ordering_layer import Admin
from ordering_layer.spark import read_ordered, restore_order, undecodable
from tests.spark.workload import Workload

pytestmark = [pytest.mark.spark, pytest.mark.integration]


@pytest.fixture(scope="module")
def workload(kafka_config: dict[str, Any], admin: Admin) -> Iterator[Workload]:
    """40 keys over 3 then 5 partitions, with copies, unordered messages and undecodable records."""
    topic = f"spark-batch-{uuid.uuid4().hex[:8]}"
    admin.create_topic(topic, partitions=3)
    work = Workload(kafka_config, admin, topic, keys=40, partitions=3)
    try:
        work.publish_rounds(4)
        work.publish_unordered(10)
        # Copies land in the same partitions, between a key's originals and its later messages.
        work.republish(every=3, partitioner="murmur2_random")
        work.publish_rounds(3)
        work.inject_undecodable(work.keys[0], "bad-value")
        work.publish_rounds(1)
        work.raise_partitions(5)
        work.publish_rounds(3)
        work.inject_undecodable(work.keys[1], "no-headers")
        work.inject_undecodable(None, "bad-key")
        work.inject_undecodable(None, "no-headers")
        work.publish_rounds(2)
        # Copies routed by another partitioner over 5 partitions: records stamped with 3 partitions
        # now sit in partitions their count does not route their key to.
        work.republish(every=4, partitioner="consistent_random")
        work.republish(every=2, partitioner="consistent_random", keyed=False)
    finally:
        work.close()
    yield work


@pytest.fixture(scope="module")
def read_rows(spark: SparkSession, workload: Workload, kafka_config: dict[str, Any]) -> list[Row]:
    """Every record of the workload's topic as ``read_ordered`` decodes it."""
    return read_ordered(spark, workload.topic, kafka_config["bootstrap.servers"]).collect()


def test_reader_decodes_every_record(read_rows: list[Row], workload: Workload) -> None:
    """SPK-1: Spark's Kafka source with headers, envelope decoded: key, id, sequence number,
    partition, offset, partition count, append time, attributes and data of every record."""
    published = workload.published
    total = len(published) + workload.copies + workload.undecodable
    assert len(read_rows) == total
    decoded = [row for row in read_rows if row.error is None]
    assert len(decoded) == len(published) + workload.copies
    for row in decoded:
        data, attributes = published[row.message_id]
        assert (row.data, row.attributes) == (data, attributes)
        assert row.sequence_number == (row.partition << 48) | row.offset
        assert row.partition_count in (3, 5)
        assert row.enqueued_time is not None
        assert row.topic == workload.topic
    keys = {message_id: key for key, ids in workload.truth.items() for message_id in ids}
    assert all(row.ordering_key == keys.get(row.message_id) for row in decoded)
    # The workload moved keys: some key has records in two partitions.
    partitions: dict[str, set[int]] = defaultdict(set)
    for row in decoded:
        if row.ordering_key is not None and row.message_id in set(workload.truth[row.ordering_key]):
            partitions[row.ordering_key].add(row.partition)
    assert any(len(found) > 1 for found in partitions.values())


def test_undecodable_records_are_reported_not_fatal(spark: SparkSession, workload: Workload,
                                                    kafka_config: dict[str, Any]) -> None:
    """DLQ-4 / SPK-1: undecodable records (bad value, missing headers, key not UTF-8) are listed
    with the reason by ``undecodable()`` and never fail the read or the order restoring."""
    df = read_ordered(spark, workload.topic, kafka_config["bootstrap.servers"])
    bad = undecodable(df).collect()
    assert len(bad) == workload.undecodable == 4
    assert all(row.error and row.value is not None for row in bad)
    reasons = " | ".join(row.error for row in bad)
    assert "trailing bytes" in reasons and "ol-envelope" in reasons
    assert {row.ordering_key for row in bad} == {workload.keys[0], workload.keys[1], None}


def test_restore_order_matches_ground_truth(spark: SparkSession, workload: Workload, read_rows: list[Row],
                                            kafka_config: dict[str, Any]) -> None:
    """SPK-2: per key, sequence order (partition count at publish, offset) with duplicate message ids
    dropped and numbered 1..n is exactly the publish order, across a partition count raised mid-way
    and raw copies written to other partitions; gaps are flagged exactly after undecodable records
    of the key; unordered messages pass through once each."""
    restored = restore_order(read_ordered(spark, workload.topic, kafka_config["bootstrap.servers"])).collect()

    per_key: dict[str, list[Row]] = defaultdict(list)
    unordered = []
    for row in restored:
        if row.ordering_key is None:
            unordered.append(row)
        else:
            per_key[row.ordering_key].append(row)
    assert set(per_key) == set(workload.keys)
    for key, rows in per_key.items():
        rows.sort(key=lambda r: r.key_sequence)
        assert [r.key_sequence for r in rows] == list(range(1, len(rows) + 1)), key
        assert [r.message_id for r in rows] == workload.truth[key], key
    assert {r.message_id for rows in per_key.values() for r in rows if r.gap} == workload.expected_gaps
    assert len(workload.expected_gaps) == 2
    assert sorted(r.message_id for r in unordered) == sorted(workload.unordered)
    assert all(r.key_sequence is None and not r.gap for r in unordered)

    # The workload holds what makes naive restoring fail: a plain (partition_count, offset) sort
    # keeping the first of each id puts some copy in a wrong place.
    naive: dict[str, list[str]] = defaultdict(list)
    for row in sorted((r for r in read_rows if r.error is None and r.ordering_key is not None),
                      key=lambda r: (r.partition_count, r.offset)):
        if row.message_id not in naive[row.ordering_key]:
            naive[row.ordering_key].append(row.message_id)
    assert any(naive[key] != workload.truth[key] for key in workload.keys)
