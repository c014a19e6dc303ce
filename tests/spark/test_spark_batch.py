"""Spark batch reading and order restoring against the real broker: SPK-1, SPK-2, PUB-6, PUB-7, DLQ-4."""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
from pyspark.sql import Row, SparkSession

from ordering_layer import Admin
from ordering_layer.record import display_key, sequence_number
from ordering_layer.spark import read_ordered, restore_order
from tests.spark.workload import Workload

pytestmark = [pytest.mark.spark, pytest.mark.integration]

PLAIN = b"plain-a"
SPLIT = b"plain-split"
NOT_UTF8 = b"\xff\xfeplain"
LOOKALIKE = b"\\xff\\xfeplain"  # UTF-8 text equal to how NOT_UTF8 is shown
MALFORMED = [("ol-partition-count", b"abc"), ("ol-message-id", b"\xff"), ("color", b"blue"), ("bin", b"\xff\x00")]


@pytest.fixture(scope="module")
def workload(kafka_config: dict[str, Any], admin: Admin) -> Iterator[Workload]:
    """40 layer keys over 3 then 5 partitions, with copies and unordered messages, and records of a
    plain producer: keys in one partition, a key in two partitions, a non-UTF-8 key and its
    look-alike, malformed ol- headers, a null value, unordered records."""
    topic = f"spark-batch-{uuid.uuid4().hex[:8]}"
    admin.create_topic(topic, partitions=3)
    work = Workload(kafka_config, admin, topic, keys=40, partitions=3)
    try:
        work.publish_rounds(4)
        work.publish_unordered(10)
        # Copies land in the same partitions, between a key's originals and its later messages.
        work.republish(every=3, partitioner="murmur2_random")
        work.produce_plain(PLAIN, 3, partition=0, headers=[("color", b"red")], attributes={"color": "red"})
        work.produce_plain(SPLIT, 2, partition=0)
        work.produce_plain(NOT_UTF8, 2, partition=1)
        work.produce_plain(LOOKALIKE, 2, partition=1)
        work.publish_rounds(3)
        work.produce_plain(PLAIN, 1, partition=0, headers=MALFORMED, attributes={"color": "blue"}, malformed=True)
        work.produce_plain(PLAIN, 1, partition=0, value=None)
        work.produce_plain(None, 2, partition=2)
        work.raise_partitions(5)
        work.publish_rounds(3)
        work.produce_plain(SPLIT, 2, partition=1)
        work.produce_plain(NOT_UTF8, 1, partition=1)
        work.produce_plain(PLAIN, 2, partition=0)
        work.publish_rounds(2)
        # Copies routed by another partitioner over 5 partitions: records stamped with 3 partitions
        # now sit in partitions their count does not route their key to.
        work.republish(every=4, partitioner="consistent_random")
        work.republish(every=2, partitioner="consistent_random", keyed=False)
    finally:
        work.close()
    assert work.undefined == {SPLIT}
    yield work


@pytest.fixture(scope="module")
def read_rows(spark: SparkSession, workload: Workload, kafka_config: dict[str, Any]) -> list[Row]:
    """Every record of the workload's topic as ``read_ordered`` reads it."""
    return read_ordered(spark, workload.topic, kafka_config["bootstrap.servers"]).collect()


@pytest.fixture(scope="module")
def restored(spark: SparkSession, workload: Workload, kafka_config: dict[str, Any]) -> dict[bytes | None, list[Row]]:
    """``restore_order`` of the workload's topic: per key bytes (None: unordered), the rows in
    ``key_sequence`` order."""
    per_key: dict[bytes | None, list[Row]] = defaultdict(list)
    for row in restore_order(read_ordered(spark, workload.topic, kafka_config["bootstrap.servers"])).collect():
        per_key[bytes(row.key) if row.key is not None else None].append(row)
    for key, rows in per_key.items():
        if key is not None:
            rows.sort(key=lambda r: r.key_sequence)
    return per_key


def test_reader_reads_every_record_as_written(read_rows: list[Row], workload: Workload) -> None:
    """SPK-1 / PUB-6 / PUB-7: Spark's Kafka source with headers; every record is a message, whoever
    wrote it: payload byte for byte (a null value is empty), attributes from the headers (non-UTF-8
    values left out), message id from ``ol-message-id`` or the sequence number, partition count from
    ``ol-partition-count`` (null for the plain producer's records), key bytes and their text."""
    assert len(read_rows) == workload.records + workload.copies
    for row in read_rows:
        written = workload.written[row.message_id]
        assert (bytes(row.data), row.attributes) == (written.data, written.attributes), row
        assert row.sequence_number == sequence_number(row.partition, row.offset)
        assert row.enqueued_time is not None and row.topic == workload.topic
        key = bytes(row.key) if row.key is not None else None
        assert row.ordering_key == (display_key(key) if key is not None else None)
        if "#" not in row.message_id:  # no id header: the id is the sequence number of the first record
            assert row.message_id == str(sequence_number(written.partition, written.offset))
        plain = key in (PLAIN, SPLIT, NOT_UTF8, LOOKALIKE) or (key is None and row.partition_count is None)
        assert (row.partition_count is None) == plain, row
        assert plain or row.partition_count in (3, 5)
    texts = {bytes(row.key): row.ordering_key for row in read_rows if row.key is not None}
    assert texts[NOT_UTF8] == texts[LOOKALIKE] == "\\xff\\xfeplain"
    assert any(row.data == b"" and bytes(row.key or b"") == PLAIN for row in read_rows)


def test_malformed_ol_headers_are_ignored_and_reported(read_rows: list[Row], workload: Workload) -> None:
    """DLQ-4 / PUB-7: a record whose ol- headers are malformed is read as a plain record (no
    partition count, the sequence number as id, attributes from its other headers) and
    ``malformed_metadata`` names the ignored headers; other records have none."""
    flagged = [row for row in read_rows if row.malformed_metadata is not None]
    assert len(flagged) == workload.malformed == 1
    row = flagged[0]
    assert row.malformed_metadata == "ol-partition-count,ol-message-id"
    assert row.partition_count is None and row.message_id == str(row.sequence_number)
    assert row.attributes == {"color": "blue"}


def test_restore_order_matches_ground_truth(restored: dict[bytes | None, list[Row]], read_rows: list[Row],
                                            workload: Workload) -> None:
    """SPK-2: per key, sequence order (partition count at publish, offset) with duplicate message ids
    dropped and numbered 1..n is exactly the publish order, across a partition count raised mid-way
    and raw copies written to other partitions; unordered messages pass through once each."""
    assert set(restored) - {None} == set(workload.truth)
    for key in workload.truth:
        rows = restored[key]
        assert [r.key_sequence for r in rows] == list(range(1, len(rows) + 1)), key
        if key not in workload.undefined:
            assert [r.message_id for r in rows] == workload.truth[key], key
            assert not any(r.order_undefined for r in rows), key
    assert sorted(r.message_id for r in restored[None]) == sorted(workload.unordered)
    assert all(r.key_sequence is None and not r.order_undefined for r in restored[None])

    # The workload holds what makes naive restoring fail: a plain (partition_count, offset) sort
    # keeping the first of each id puts some copy in a wrong place.
    naive: dict[bytes, list[str]] = defaultdict(list)
    layer_rows = (r for r in read_rows if r.partition_count is not None and r.key is not None)
    for row in sorted(layer_rows, key=lambda r: (r.partition_count, r.offset)):
        if row.message_id not in naive[bytes(row.key)]:
            naive[bytes(row.key)].append(row.message_id)
    assert any(naive[key] != workload.truth[key] for key in workload.keys)


def test_plain_producer_keys_in_one_partition_are_ordered_by_offset(restored: dict[bytes | None, list[Row]],
                                                                    workload: Workload) -> None:
    """PUB-7: a plain producer's keys, each in one partition, come in write (offset) order,
    numbered and not flagged, the non-UTF-8 key and its look-alike text as two keys."""
    for key in (PLAIN, NOT_UTF8, LOOKALIKE):
        rows = restored[key]
        assert [r.message_id for r in rows] == workload.truth[key], key
        assert [r.offset for r in rows] == sorted(r.offset for r in rows)
        assert not any(r.order_undefined for r in rows), key
    assert len(restored[NOT_UTF8]) == 3 and len(restored[LOOKALIKE]) == 2


def test_plain_producer_key_in_two_partitions_is_flagged(restored: dict[bytes | None, list[Row]],
                                                         workload: Workload) -> None:
    """PUB-7: a key written by a plain producer into two partitions (explicit partition argument)
    has no order the records define: all its messages are emitted, numbered, and flagged
    ``order_undefined``; no other key is flagged."""
    rows = restored[SPLIT]
    assert sorted(r.message_id for r in rows) == sorted(workload.truth[SPLIT]) and len(rows) == 4
    assert {r.partition for r in rows} == {0, 1}
    assert all(r.order_undefined for r in rows)
    flagged = {key for key, rows in restored.items() if any(r.order_undefined for r in rows)}
    assert flagged == {SPLIT}
