"""The wire format: plain Kafka records, layer metadata in ol- headers (PUB-6, PUB-7, DLQ-4)."""

from __future__ import annotations

import pytest

from ordering_layer.record import (
    HEADER_MESSAGE_ID,
    HEADER_PARTITION_COUNT,
    RecordMetadata,
    attributes_of,
    display_key,
    read_metadata,
    sequence_number,
)


def test_layer_metadata_is_read_from_headers() -> None:
    """PUB-6: the partition count and, when given, the message id travel in ol- headers."""
    headers = [(HEADER_PARTITION_COUNT, b"6"), ("color", b"blue"), (HEADER_MESSAGE_ID, b"order-17")]
    assert read_metadata(headers) == RecordMetadata("order-17", 6, None)
    assert read_metadata([(HEADER_PARTITION_COUNT, "12")]) == RecordMetadata(None, 12, None)


def test_records_of_any_producer_have_no_metadata() -> None:
    """PUB-7: a record without ol- headers is a plain message (no id header: id = sequence number)."""
    assert read_metadata(None) == RecordMetadata(None, None, None)
    assert read_metadata([("traceparent", b"00-ab"), ("bin", b"\xff\x00")]) == RecordMetadata(None, None, None)


@pytest.mark.parametrize("headers, named", [
    ([(HEADER_PARTITION_COUNT, b"0")], HEADER_PARTITION_COUNT),
    ([(HEADER_PARTITION_COUNT, b"-3")], HEADER_PARTITION_COUNT),
    ([(HEADER_PARTITION_COUNT, b"six")], HEADER_PARTITION_COUNT),
    ([(HEADER_PARTITION_COUNT, None)], HEADER_PARTITION_COUNT),
    ([(HEADER_PARTITION_COUNT, b"9" * 40)], HEADER_PARTITION_COUNT),
    ([(HEADER_MESSAGE_ID, b"")], HEADER_MESSAGE_ID),
    ([(HEADER_MESSAGE_ID, b"\xff\xfe")], HEADER_MESSAGE_ID),
    ([(HEADER_MESSAGE_ID, b"x" * 257)], HEADER_MESSAGE_ID),
])
def test_malformed_metadata_is_ignored_and_described(headers: list[tuple[str, bytes | None]], named: str) -> None:
    """DLQ-4: a malformed ol- header never refuses the record; it is ignored and described."""
    metadata = read_metadata(headers)
    assert metadata.message_id is None and metadata.partition_count is None
    assert metadata.malformed is not None and named in metadata.malformed


def test_unknown_reserved_headers_are_left_alone() -> None:
    """DLQ-4: ol- names this version does not know (newer layers, dead-letter facts) are not errors."""
    assert read_metadata([("ol-dlq-reason", b"PARKED_KEY"), ("ol-future", b"?")]).malformed is None


def test_attributes_are_utf8_headers_outside_the_reserved_prefix() -> None:
    """PUB-6, PUB-7: attributes = headers with UTF-8 values; ol- metadata, null and binary values stay out."""
    headers: list[tuple[str, str | bytes | None]] = [
        (HEADER_PARTITION_COUNT, b"6"), ("v", b"1"), ("bin", b"\xff"), ("none", None), ("v", b"2"),
        ("text", "caf\u00e9")]
    assert attributes_of(headers) == {"v": "2", "text": "caf\u00e9"}
    assert attributes_of({"a": b"x"}) == {"a": "x"}
    assert attributes_of(None) == {}


def test_display_key() -> None:
    """PUB-7: a key that is not UTF-8 shows with escapes; the layer orders by the exact bytes."""
    assert display_key(b"customer-1") == "customer-1"
    assert display_key(b"\xffab") == "\\xffab"
    assert display_key(None) == display_key(b"") == ""


def test_sequence_number_layout() -> None:
    """PUB-3: the partition in the upper 16 bits, the offset below."""
    assert sequence_number(3, 5) == (3 << 48) | 5
