"""The wire format: an Avro envelope as the record value, layer metadata in Kafka headers (PUB-6).

The value is the ``Envelope`` record of ``schemas/envelope.avsc`` in fastavro's schemaless
encoding; the headers carry what plain Kafka tools and Spark need without Avro: the message id,
the partition count used to route the record, and the envelope version. Schemas are parsed once.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

import fastavro

from ordering_layer.errors import EnvelopeError

HEADER_MESSAGE_ID = "ol-message-id"
HEADER_PARTITION_COUNT = "ol-partition-count"
HEADER_ENVELOPE = "ol-envelope"
ENVELOPE_VERSION = b"1"

HeaderValue = str | bytes | None
Headers = Sequence[tuple[str, HeaderValue]] | Mapping[str, HeaderValue]


def _schema_path(name: str) -> Path:
    """``schemas/<name>.avsc`` (``ordering_layer/_schemas`` links to the top-level folder)."""
    return Path(str(resources.files("ordering_layer"))) / "_schemas" / f"{name}.avsc"


@cache
def parsed_schema(name: str) -> Any:
    """The parsed Avro schema ``schemas/<name>.avsc`` (parsed once per process).

    ``attribute_map`` is the envelope's ``attributes`` field alone, as a one-field record: its
    encoding equals the map's, which is what ``encode_envelope`` appends after the payload.
    """
    if name == "attribute_map":
        envelope = json.loads(_schema_path("envelope").read_text())
        field = next(f for f in envelope["fields"] if f["name"] == "attributes")
        return fastavro.parse_schema({"type": "record", "name": "AttributeMap", "fields": [field]})
    return fastavro.parse_schema(json.loads(_schema_path(name).read_text()))


def encode(schema_name: str, record: Mapping[str, Any]) -> bytes:
    """Schemaless Avro encoding of ``record`` with the named schema."""
    out = io.BytesIO()
    fastavro.schemaless_writer(out, parsed_schema(schema_name), record)
    return out.getvalue()


def decode(schema_name: str, payload: bytes) -> dict[str, Any]:
    """Decode a schemaless Avro payload; raises ``EnvelopeError`` when it is not one."""
    stream = io.BytesIO(payload)
    try:
        record = fastavro.schemaless_reader(stream, parsed_schema(schema_name), None)
    except Exception as exc:
        raise EnvelopeError(f"value is not a valid {schema_name} record: {exc!r}") from exc
    if stream.tell() != len(payload):
        raise EnvelopeError(f"value has {len(payload) - stream.tell()} trailing bytes after the {schema_name} record")
    if not isinstance(record, dict):
        raise EnvelopeError(f"value is not a {schema_name} record")
    return record


def _zigzag_varint(value: int) -> bytes:
    """Avro's ``long`` encoding (zig-zag, then base-128 varint)."""
    n = (value << 1) ^ (value >> 63)
    out = bytearray()
    while n & ~0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_EMPTY_MAP = b"\x00"


def encode_envelope(data: bytes, attributes: Mapping[str, str]) -> bytes:
    """The record value for a message: its payload and attributes.

    A record's Avro encoding is its fields' encodings in order, so the hot path writes the ``bytes``
    field directly (length, then payload) and lets fastavro encode only a non-empty attribute map;
    ``tests/unit/test_envelope.py`` checks this against fastavro's full encoding.
    """
    head = _zigzag_varint(len(data))
    if not attributes:
        return b"".join((head, data, _EMPTY_MAP))
    return b"".join((head, data, encode("attribute_map", {"attributes": attributes})))


def make_headers(message_id: str, partition_count: int) -> list[tuple[str, bytes]]:
    """The layer headers of a published record."""
    return [
        (HEADER_MESSAGE_ID, message_id.encode()),
        (HEADER_PARTITION_COUNT, str(partition_count).encode()),
        (HEADER_ENVELOPE, ENVELOPE_VERSION),
    ]


class DecodedRecord(NamedTuple):
    """A layer message decoded from a Kafka record."""

    message_id: str
    partition_count: int
    ordering_key: str | None
    data: bytes
    attributes: dict[str, str]


def decode_record(key: bytes | None, value: bytes | None, headers: Headers | None) -> DecodedRecord:
    """Decode key, value and headers of a record the layer published.

    Raises:
        EnvelopeError: missing or malformed headers, a key that is not UTF-8, or a bad value.
    """
    found: dict[str, HeaderValue] = dict(headers or ())
    version = found.get(HEADER_ENVELOPE)
    if version != ENVELOPE_VERSION:
        raise EnvelopeError(f"header {HEADER_ENVELOPE} is {version!r}, expected {ENVELOPE_VERSION!r}")
    raw_id = found.get(HEADER_MESSAGE_ID)
    raw_count = found.get(HEADER_PARTITION_COUNT)
    try:
        if not isinstance(raw_id, bytes) or not raw_id:
            raise ValueError("missing")
        message_id = raw_id.decode()
    except ValueError as exc:
        raise EnvelopeError(f"header {HEADER_MESSAGE_ID} is missing or malformed: {raw_id!r}") from exc
    try:
        partition_count = int(raw_count if isinstance(raw_count, bytes) else b"")
        if partition_count < 1:
            raise ValueError("not positive")
    except ValueError as exc:
        raise EnvelopeError(f"header {HEADER_PARTITION_COUNT} is missing or malformed: {raw_count!r}") from exc
    try:
        ordering_key = key.decode() if key else None
    except UnicodeDecodeError as exc:
        raise EnvelopeError(f"record key is not valid UTF-8: {key!r}") from exc
    if value is None:
        raise EnvelopeError("record has no value")
    data, attributes = decode_envelope(value)
    return DecodedRecord(message_id, partition_count, ordering_key, data, attributes)


def decode_envelope(value: bytes) -> tuple[bytes, dict[str, str]]:
    """Payload and attributes of an envelope; raises ``EnvelopeError`` when it is not one.

    The mirror of ``encode_envelope``'s fast path: a value that is exactly a length, that many
    payload bytes and an empty attribute map (a lone zero byte) is sliced directly; anything else
    (attributes, malformed values) goes through fastavro. ``tests/unit/test_envelope.py`` checks
    both against fastavro.
    """
    length = shift = pos = 0
    size = len(value)
    while pos < size and pos < 10:
        byte = value[pos]
        length |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            length = (length >> 1) ^ -(length & 1)
            end = pos + length
            if length >= 0 and end + 1 == size and value[end] == 0:
                return value[pos:end], {}
            break
        shift += 7
    envelope = decode("envelope", value)
    return envelope["data"], envelope["attributes"]
