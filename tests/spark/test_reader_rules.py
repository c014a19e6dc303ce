"""The reader's Spark SQL expressions follow ``ordering_layer.record``'s rules (SPK-1, PUB-6, PUB-7, DLQ-4).

Records in the shape of Spark's Kafka source are read by ``reader.messages`` and compared, record
by record, with ``record.read_metadata``, ``record.attributes_of`` and ``record.display_key``.
"""

from __future__ import annotations

import datetime
import random
from typing import Any

import pytest
from pyspark.sql import SparkSession

from ordering_layer.record import attributes_of, display_key, read_metadata, sequence_number
from ordering_layer.spark.reader import COLUMNS, messages

pytestmark = pytest.mark.spark

SOURCE = ("key binary, value binary, topic string, partition int, offset long, timestamp timestamp, "
          "timestampType int, headers array<struct<key: string, value: binary>>")

KEYS: list[bytes | None] = [
    None, b"", b"abc", "é€𝄞".encode(), b"\xff", b"a\xffb", b"\xc3", b"\xc3(", b"\xe2\x82", b"\xed\xa0\x80",
    b"\xc0\xaf", b"\xf4\x90\x80\x80", b"\xf0\x9f\x98", b"\\xff", b"\xe0\x80\x80", b"\xef\xbf\xbf", b"\x00\x7f\x80"]
HEADERS: list[list[tuple[str, bytes | None]] | None] = [
    None, [],
    [("ol-partition-count", b"6"), ("ol-message-id", b"order-17"), ("color", b"blue")],
    [("ol-partition-count", b"0")], [("ol-partition-count", b"-1")], [("ol-partition-count", b"abc")],
    [("ol-partition-count", b"")], [("ol-partition-count", None)], [("ol-partition-count", b"007")],
    [("ol-partition-count", b"9223372036854775807")], [("ol-partition-count", b"\xff")],
    [("ol-partition-count", b"3"), ("ol-partition-count", b"x"), ("ol-partition-count", b"5")],
    [("ol-message-id", b"")], [("ol-message-id", None)], [("ol-message-id", b"\xff\xfe")],
    [("ol-message-id", b"x" * 256)], [("ol-message-id", b"x" * 257)], [("ol-message-id", "ü".encode())],
    [("ol-message-id", b"a"), ("ol-message-id", b"b")], [("ol-unknown", b"z"), ("ol-", b"")],
    [("a", b"1"), ("a", b"2"), ("b", None), ("c", b"\xff"), ("a", b"\xfe"), ("d", b""), ("", b"e")],
]


def _random_headers(rng: random.Random) -> list[tuple[str, bytes | None]]:
    names = ["ol-partition-count", "ol-message-id", "a", "b", "ol-x"]
    values: list[bytes | None] = [None, b"", b"1", b"12", b"0", b"x", b"\xff", b"id-\xc3\xa9", b"\xc3"]
    return [(rng.choice(names), rng.choice(values)) for _ in range(rng.randint(0, 5))]


def test_reader_follows_the_record_rules(spark: SparkSession) -> None:
    """SPK-1 / PUB-7 / DLQ-4: for keys of any bytes and headers well-formed or not, ``messages``
    gives the payload byte for byte (null value: empty), the attributes, message id (header or
    sequence number), partition count and key text that ``ordering_layer.record`` gives, and flags
    exactly the records whose ``ol-`` headers ``record`` finds malformed."""
    rng = random.Random(10)
    cases = [(key, headers) for key in KEYS for headers in HEADERS[:3]] + [(b"k", h) for h in HEADERS]
    cases += [(bytes(rng.randrange(256) for _ in range(rng.randint(1, 6))), _random_headers(rng)) for _ in range(300)]
    when = datetime.datetime(2026, 1, 1)
    rows: list[tuple[Any, ...]] = [
        (key, None if i % 7 == 0 else bytes([i % 256, 0, 255]), "t", i % 4, i * 3, when, 1, headers)
        for i, (key, headers) in enumerate(cases)]
    result = messages(spark.createDataFrame(rows, SOURCE)).collect()
    assert tuple(result[0].asDict()) == COLUMNS
    for (key, value, _, partition, offset, _, _, headers), row in zip(rows, result, strict=True):
        metadata = read_metadata(headers)
        case = (key, headers)
        assert (bytes(row.key) if row.key is not None else None) == (key or None), case
        assert row.ordering_key == (display_key(key) if key else None), case
        assert bytes(row.data) == (value or b""), case
        assert row.attributes == attributes_of(headers), case
        assert row.message_id == (metadata.message_id or str(sequence_number(partition, offset))), case
        assert row.partition_count == metadata.partition_count, case
        ignored = [problem.split("=", 1)[0] for problem in metadata.malformed.split("; ")] if metadata.malformed else []
        assert row.malformed_metadata == (",".join(ignored) or None), case
