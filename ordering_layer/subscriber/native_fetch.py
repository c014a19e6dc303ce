"""The fetch without a Python object per fetched message: ``_core.NativeFetch`` on the consumer's
own librdkafka handle.

confluent-kafka's ``consume()`` makes a ``Message`` per record under the GIL, which the fetcher then
reads into a ``Record``. ``NativeFetch`` takes the records from librdkafka itself: the assigned
partitions' fetch queues are forwarded to a queue of its own (``attach`` after an assignment,
``detach`` before a revocation or loss), it waits for a batch and copies it without the GIL, and it
makes the ``Record``s directly, reading the layer metadata once per distinct header set. The
``Consumer`` keeps everything else: membership, rebalance callbacks, commits, seeks, pauses; its
queue carries only events, served by ``consume`` on the fetch thread as before.

The handle is the ``rd_kafka_t`` pointer that confluent-kafka's consumer object holds first after
its object header, in the librdkafka it loaded (looked up in the process's mappings); the handle
must be a consumer whose name begins with the consumer's ``client.id``, or the fetch is not used.
``open_native_fetch`` returns None whenever anything does not match (another platform, another
build of confluent-kafka), or when ``ORDERING_LAYER_NATIVE_FETCH=0`` is set, and the fetcher then
uses ``consume()``.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer

from ordering_layer._core import NativeFetch
from ordering_layer.record import HeaderPairs, RecordMetadata, read_metadata
from ordering_layer.subscriber.fetched import read_headers
from ordering_layer.subscriber.key_queue import Record
from ordering_layer.subscriber.owned_partition import RECORD_LAYOUT

_LOGGER = logging.getLogger(__name__)

_HANDLE_OFFSET = 2 * ctypes.sizeof(ctypes.c_void_p)  # after ob_refcnt and ob_type
DEFAULT_CLIENT_ID = "rdkafka"  # librdkafka's default client.id

Malformed = Callable[[Record], None]


def loaded_librdkafka() -> str | None:
    """The path of the librdkafka this process has loaded (Linux: from ``/proc/self/maps``)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if "/librdkafka" in path and ".so" in path:
                    return path
    except OSError:
        return None
    return None


def header_metadata(malformed: Malformed) -> Callable[[HeaderPairs, int, int], tuple[RecordMetadata, Any, bool]]:
    """``NativeFetch``'s ``metadata_of``: ``read_headers`` of a record's headers, with malformed
    metadata reported (DLQ-4) at the record's position."""

    def metadata_of(headers: HeaderPairs, partition: int, offset: int) -> tuple[RecordMetadata, Any, bool]:
        metadata, kept, shareable = read_headers(headers)
        if metadata.malformed is not None:
            malformed(Record(partition, offset, None, None, headers, metadata, 0, 0))
        return metadata, kept, shareable

    return metadata_of


def open_native_fetch(consumer: Consumer, config: dict[str, Any], topic: str,
                      malformed: Malformed) -> NativeFetch | None:
    """A ``NativeFetch`` on ``consumer``, or None when it cannot be used here (logged) or is switched
    off (``ORDERING_LAYER_NATIVE_FETCH=0`` in the environment)."""
    if os.environ.get("ORDERING_LAYER_NATIVE_FETCH", "1") == "0":
        return None
    library = loaded_librdkafka()
    if library is None or type(consumer) is not Consumer:
        _LOGGER.info("fetching through consume(): no librdkafka mapping or not a plain Consumer")
        return None
    handle = ctypes.c_void_p.from_address(id(consumer) + _HANDLE_OFFSET).value
    prefix = f"{config.get('client.id', DEFAULT_CLIENT_ID)}#consumer-"
    try:
        return NativeFetch(consumer, handle or 0, library, prefix, topic, RECORD_LAYOUT, header_metadata(malformed),
                           read_metadata(None))
    except RuntimeError as exc:
        _LOGGER.info("fetching through consume(): %s", exc)
        return None
