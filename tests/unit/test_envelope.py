"""The envelope: Avro value plus layer headers (PUB-6), and its decode errors (DLQ-4)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import fastavro
import pytest

from ordering_layer.envelope import (
    HEADER_ENVELOPE,
    HEADER_MESSAGE_ID,
    HEADER_PARTITION_COUNT,
    decode,
    decode_envelope,
    decode_record,
    encode,
    encode_envelope,
    make_headers,
)
from ordering_layer.errors import EnvelopeError

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


def test_envelope_round_trip_and_plain_avro_reader() -> None:
    """PUB-6: the value is schemaless Avro of schemas/envelope.avsc, readable without the layer."""
    value = encode_envelope(b"\x00payload", {"v": "1", "kind": "order"})
    schema = fastavro.parse_schema(json.loads((SCHEMAS / "envelope.avsc").read_text()))
    plain = fastavro.schemaless_reader(io.BytesIO(value), schema, None)
    assert plain == {"data": b"\x00payload", "attributes": {"v": "1", "kind": "order"}}
    decoded = decode_record(b"customer-1", value, make_headers("m-1", 6))
    assert decoded.message_id == "m-1"
    assert decoded.partition_count == 6
    assert decoded.ordering_key == "customer-1"
    assert decoded.data == b"\x00payload"
    assert decoded.attributes == {"v": "1", "kind": "order"}


def test_dead_letter_schema_encodes() -> None:
    """DLQ-2: the dead-letter record schema carries the source facts and the raw record."""
    record = {"source_topic": "t", "source_partition": 2, "source_offset": 7, "sequence_number": (2 << 48) | 7,
              "subscription": "s", "reason": "UNDECODABLE", "delivery_attempts": 0, "last_error": "bad",
              "key": b"k", "value": b"\xff", "headers": [{"key": "h", "value": None}]}
    schema = fastavro.parse_schema(json.loads((SCHEMAS / "dead_letter.avsc").read_text()))
    assert fastavro.schemaless_reader(io.BytesIO(encode("dead_letter", record)), schema, None) == record


GOOD = encode_envelope(b"x", {})


@pytest.mark.parametrize(("key", "value", "headers", "reason"), [
    (b"k", b"\xff\xff\xff\xff\xff", make_headers("m", 1), "valid envelope"),
    (b"k", GOOD + b"junk", make_headers("m", 1), "trailing"),
    (b"k", None, make_headers("m", 1), "no value"),
    (b"k", GOOD, [], HEADER_ENVELOPE),
    (b"k", GOOD, [(HEADER_ENVELOPE, b"2"), (HEADER_MESSAGE_ID, b"m"), (HEADER_PARTITION_COUNT, b"1")],
     HEADER_ENVELOPE),
    (b"k", GOOD, [(HEADER_ENVELOPE, b"1"), (HEADER_PARTITION_COUNT, b"1")], HEADER_MESSAGE_ID),
    (b"k", GOOD, [(HEADER_ENVELOPE, b"1"), (HEADER_MESSAGE_ID, b"m"), (HEADER_PARTITION_COUNT, b"x")],
     HEADER_PARTITION_COUNT),
    (b"k", GOOD, [(HEADER_ENVELOPE, b"1"), (HEADER_MESSAGE_ID, b"m"), (HEADER_PARTITION_COUNT, b"0")],
     HEADER_PARTITION_COUNT),
    (b"\xc3\x28", GOOD, make_headers("m", 1), "UTF-8"),
])
def test_undecodable_records_raise_typed_error(key: bytes, value: bytes | None,
                                               headers: list[tuple[str, bytes | None]], reason: str) -> None:
    """DLQ-4: bad Avro, missing or malformed headers and a bad key give EnvelopeError with the reason."""
    with pytest.raises(EnvelopeError, match=reason):
        decode_record(key, value, headers)


@pytest.mark.parametrize("size", [0, 1, 63, 64, 127, 128, 8191, 8192, 1_000_000])
@pytest.mark.parametrize("attributes", [{}, {"a": "1"}, {"kind": "order", "é": "ü" * 70}])
def test_fast_envelope_encoding_equals_fastavro(size: int, attributes: dict[str, str]) -> None:
    """PUB-6: the hot-path envelope encoder writes exactly fastavro's schemaless encoding."""
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    assert encode_envelope(data, attributes) == encode("envelope", {"data": data, "attributes": attributes})


@pytest.mark.parametrize("size", [0, 1, 63, 64, 127, 128, 8191, 8192, 1_000_000])
@pytest.mark.parametrize("attributes", [{}, {"a": "1"}, {"kind": "order", "é": "ü" * 70}])
def test_fast_envelope_decoding_equals_fastavro(size: int, attributes: dict[str, str]) -> None:
    """PUB-6: the hot-path envelope decoder reads what fastavro reads."""
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    value = encode("envelope", {"data": data, "attributes": attributes})
    expected = decode("envelope", value)
    assert decode_envelope(value) == (expected["data"], expected["attributes"])


@pytest.mark.parametrize("value", [b"", b"\x80", b"\x02x", b"\x04x\x00", b"\x02xx", b"\x02x\x00\x00", b"\x01\x00",
                                   b"\xff" * 11, b"\x02x\x02"])
def test_fast_envelope_decoding_refuses_what_fastavro_refuses(value: bytes) -> None:
    """DLQ-4: truncated, over-long, negative-length or trailing-byte values raise EnvelopeError."""
    with pytest.raises(EnvelopeError):
        decode_envelope(value)
