"""The wire format: a message is a plain Kafka record (PUB-6, PUB-7).

* key: the ordering key (UTF-8 when published through the layer; any bytes from other producers,
  compared as bytes); absent or empty: unordered;
* value: the payload, byte for byte (a null value is an empty payload);
* headers: the attributes (name -> UTF-8 value), plus the layer's metadata under ``ol-``:
  ``ol-partition-count`` (the partition count the key was routed with, so per-key order stays
  ``(partition_count_at_publish, offset)`` after partitions are added) and, only where one was given
  or must be kept, ``ol-message-id``;
* timestamp: the broker's append time (topics are created with ``LogAppendTime``).

Without an ``ol-message-id`` header the message id is the decimal sequence number
(``partition << 48 | offset``). Any Kafka client reads and writes these records; a record of any
producer is a message. Malformed ``ol-`` metadata is never a reason to refuse a record: it is
reported in ``RecordMetadata.malformed`` and the record is read as a plain record (DLQ-4).

``encode_ordering_key`` and ``attribute_headers`` check what a publish or a schedule writes (PUB-4);
Kafka's key partitioner is ``kafka.partitioner``.

Avro (fastavro, ``schemas/``) is only for the layer's own records: dead letters, schedules,
snapshots (``encode``/``decode`` below).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

import fastavro

from ordering_layer.config import MAX_ORDERING_KEY_BYTES
from ordering_layer.errors import InvalidMessageError, InvalidOrderingKeyError, RecordFormatError

RESERVED_PREFIX = "ol-"
HEADER_PARTITION_COUNT = "ol-partition-count"
HEADER_MESSAGE_ID = "ol-message-id"
MAX_MESSAGE_ID_BYTES = 256

HeaderValue = str | bytes | None
HeaderPairs = Sequence[tuple[str, HeaderValue]]
Headers = HeaderPairs | Mapping[str, HeaderValue]


def sequence_number(partition: int, offset: int) -> int:
    """The 64-bit sequence number of a record: partition in the upper 16 bits, offset below."""
    return (partition << 48) | offset


def display_key(key: bytes | None) -> str:
    """The ordering key as text: the key itself when UTF-8, else with ``\\xNN`` escapes for the
    bytes that are not (display only: the layer orders by the exact bytes). Empty when unordered."""
    if not key:
        return ""
    try:
        return key.decode()
    except UnicodeDecodeError:
        return key.decode("utf-8", "backslashreplace")


class RecordMetadata(NamedTuple):
    """The layer metadata of one fetched record, read once."""

    message_id: str | None  # from ol-message-id; None: the decimal sequence number
    partition_count: int | None  # from ol-partition-count; None: not published through the layer
    malformed: str | None  # why an ol- header was ignored (DLQ-4), else None


def read_metadata(headers: HeaderPairs | None) -> RecordMetadata:
    """Read the ``ol-`` headers of a fetched record (as confluent-kafka returns them).

    Never raises: a malformed value (a count that is not a positive integer, an id that is empty,
    too long or not UTF-8) is ignored and described in ``malformed``. Unknown ``ol-`` names are
    left alone (they may come from a newer version of the layer or from dead-letter records).
    """
    message_id: str | None = None
    count: int | None = None
    problems: list[str] = []
    for name, value in headers or ():
        if not name.startswith(RESERVED_PREFIX):
            continue
        if name == HEADER_PARTITION_COUNT:
            parsed = _positive_int(value)
            if parsed is None:
                problems.append(f"{HEADER_PARTITION_COUNT}={_shorten(value)}")
            else:
                count = parsed
        elif name == HEADER_MESSAGE_ID:
            text = _message_id(value)
            if text is None:
                problems.append(f"{HEADER_MESSAGE_ID}={_shorten(value)}")
            else:
                message_id = text
    return RecordMetadata(message_id, count, "; ".join(problems) if problems else None)


def _positive_int(value: HeaderValue) -> int | None:
    if isinstance(value, str):
        value = value.encode()
    if not value or len(value) > 19 or not value.isdigit():
        return None
    number = int(value)
    return number if number > 0 else None


def _message_id(value: HeaderValue) -> str | None:
    if isinstance(value, bytes):
        try:
            value = value.decode()
        except UnicodeDecodeError:
            return None
    if not value or len(value.encode()) > MAX_MESSAGE_ID_BYTES:
        return None
    return value


def _shorten(value: HeaderValue) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def attributes_of(headers: Headers | None) -> dict[str, str]:
    """The attributes of a record: its headers outside ``ol-`` whose values are UTF-8 text.

    Header values that are null or not UTF-8 stay in the record's headers and out of the
    attributes; a repeated name keeps its last value.
    """
    attributes: dict[str, str] = {}
    if not headers:
        return attributes
    for name, value in headers.items() if isinstance(headers, Mapping) else headers:
        if name.startswith(RESERVED_PREFIX) or value is None:
            continue
        if isinstance(value, bytes):
            try:
                attributes[name] = value.decode()
            except UnicodeDecodeError:
                continue
        else:
            attributes[name] = str(value)
    return attributes


def header_pairs(headers: Headers | None) -> list[tuple[str, HeaderValue]]:
    """Headers given as a mapping or as pairs, as a list of pairs."""
    if not headers:
        return []
    if isinstance(headers, Mapping):
        return list(headers.items())
    return list(headers)


def encode_ordering_key(ordering_key: str | bytes | None) -> tuple[str | None, bytes | None]:
    """Validate an ordering key (PUB-4); return it as text and as the Kafka record key.

    Empty or absent means unordered. Raises ``InvalidOrderingKeyError`` for a key that is not
    valid UTF-8 or is longer than 1024 bytes.
    """
    if ordering_key is None or ordering_key in ("", b""):
        return None, None
    if isinstance(ordering_key, bytes):
        try:
            text = ordering_key.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidOrderingKeyError("ordering key is not valid UTF-8", key=ordering_key) from exc
        raw = ordering_key
    elif isinstance(ordering_key, str):
        try:
            raw = ordering_key.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidOrderingKeyError("ordering key is not valid UTF-8", key=ordering_key) from exc
        text = ordering_key
    else:
        raise InvalidOrderingKeyError(
            f"ordering key must be str or bytes, not {type(ordering_key).__name__}", key=ordering_key)
    if len(raw) > MAX_ORDERING_KEY_BYTES:
        raise InvalidOrderingKeyError(
            f"ordering key is {len(raw)} bytes; at most {MAX_ORDERING_KEY_BYTES} are allowed", key=text)
    return text, raw


def attribute_headers(attributes: Mapping[str, str]) -> list[tuple[str, HeaderValue]]:
    """Attributes (str -> str) as record headers; refuses other types and ``ol-`` names (PUB-4, PUB-6)."""
    headers: list[tuple[str, HeaderValue]] = []
    for name, value in attributes.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise InvalidMessageError(f"attributes must map str to str; got {name!r}: {value!r}")
        if name.startswith(RESERVED_PREFIX):
            raise InvalidMessageError(f"attribute name {name!r} uses the reserved prefix {RESERVED_PREFIX!r}")
        headers.append((name, value.encode()))
    return headers


def reserved_names(names: Iterable[str]) -> list[str]:
    """The names among ``names`` that use the layer's reserved ``ol-`` prefix."""
    return [name for name in names if isinstance(name, str) and name.startswith(RESERVED_PREFIX)]


# -- the layer's own records (Avro) ------------------------------------------------------------------
def _schema_path(name: str) -> Path:
    """``schemas/<name>.avsc``: the top-level ``schemas`` links to ``ordering_layer/_schemas``, which
    the package carries."""
    return Path(str(resources.files("ordering_layer"))) / "_schemas" / f"{name}.avsc"


@cache
def parsed_schema(name: str) -> Any:
    """The parsed Avro schema ``schemas/<name>.avsc`` (parsed once per process)."""
    return fastavro.parse_schema(json.loads(_schema_path(name).read_text()))


def encode(schema_name: str, record: Mapping[str, Any]) -> bytes:
    """Schemaless Avro encoding of ``record`` with the named schema."""
    out = io.BytesIO()
    fastavro.schemaless_writer(out, parsed_schema(schema_name), record)
    return out.getvalue()


def decode(schema_name: str, payload: bytes, *, written_with: str | None = None) -> dict[str, Any]:
    """Decode a schemaless Avro payload; raises ``RecordFormatError`` when it is not one.

    ``written_with`` names an earlier schema the payload was written with; it is then read into
    ``schema_name``'s layout by Avro schema resolution (fields added since get their defaults).
    """
    stream = io.BytesIO(payload)
    writer = parsed_schema(written_with or schema_name)
    try:
        record = fastavro.schemaless_reader(stream, writer, parsed_schema(schema_name) if written_with else None)
    except Exception as exc:
        raise RecordFormatError(f"value is not a valid {schema_name} record: {exc!r}") from exc
    if stream.tell() != len(payload):
        raise RecordFormatError(
            f"value has {len(payload) - stream.tell()} trailing bytes after the {schema_name} record")
    if not isinstance(record, dict):
        raise RecordFormatError(f"value is not a {schema_name} record")
    return record


def now_ms() -> int:
    """The wall clock in milliseconds since the epoch (the times the layer's own records carry)."""
    return int(datetime.now(UTC).timestamp() * 1000)
