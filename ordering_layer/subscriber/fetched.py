"""A fetched record read once: its layer metadata, size and timestamp (PUB-7, DLQ-4).

``read_headers`` is the one rule both fetch paths read a record's headers by (the native fetch,
``native_fetch``, and ``consume()``); ``to_record`` makes the subscriber's ``Record`` of a message
``consume()`` returned (the fetch without the native path, and records queued before their
partition was attached to it).
"""

from __future__ import annotations

from typing import cast

from confluent_kafka import Message as KafkaMessage

from ordering_layer.record import HEADER_PARTITION_COUNT, HeaderPairs, RecordMetadata, read_metadata
from ordering_layer.subscriber.records import Record


def read_headers(headers: HeaderPairs) -> tuple[RecordMetadata, HeaderPairs, bool]:
    """A fetched record's layer metadata, the headers it keeps, and whether records with the same
    headers may share both: the layer's one-header records (only a well-formed
    ``ol-partition-count``) share one immutable copy, so that a record waiting for release keeps no
    header list of its own for the collector to walk. Both fetch paths share by this rule
    (``to_record``, ``native_fetch.NativeFetch``)."""
    metadata = read_metadata(headers)
    shareable = (len(headers) == 1 and headers[0][0] == HEADER_PARTITION_COUNT
                 and metadata.message_id is None and metadata.malformed is None)
    return metadata, tuple(headers) if shareable else headers, shareable


# The layer's one-header records (``read_headers``): metadata and shared headers by the
# value of their ``ol-partition-count``.
_PLAIN_COUNTS: dict[bytes | str | None, tuple[RecordMetadata, HeaderPairs]] = {}


def to_record(msg: KafkaMessage) -> Record:
    """A fetched Kafka record with its layer metadata read once; any record is a message (PUB-7)."""
    key, value = msg.key(), msg.value()
    headers = cast(HeaderPairs | None, msg.headers())  # a list of pairs for fetched records
    metadata = None
    if headers is not None and len(headers) == 1 and headers[0][0] == HEADER_PARTITION_COUNT:
        plain = _PLAIN_COUNTS.get(headers[0][1])
        if plain is not None:
            metadata, headers = plain
    if metadata is None:
        if headers is None:
            metadata = read_metadata(None)
        else:
            metadata, headers, shareable = read_headers(headers)
            if shareable and len(_PLAIN_COUNTS) < 64:
                _PLAIN_COUNTS[headers[0][1]] = (metadata, headers)
    partition, offset = msg.partition(), msg.offset()
    assert partition is not None and offset is not None
    return Record(partition, offset, key or None, value, headers, metadata,
                  len(value) if value else 0, msg.timestamp()[1])
