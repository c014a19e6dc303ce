"""The fetch without a Python object per fetched message: ``_core.NativeFetch`` on the consumer's
own librdkafka handle.

confluent-kafka's ``consume()`` makes a ``Message`` per record under the GIL, which the fetcher then
reads into a ``Record``. ``NativeFetch`` takes the records from librdkafka itself: the assigned
partitions' fetch queues are split off the consumer's queue and kept apart (``attach`` after an
assignment, ``detach`` before a revocation or loss); a batch takes from each in turn, or from the
partitions short of records only (``FlowGate.short``), waits for records without the GIL and copies
them, and it makes the ``Record``s directly, reading the layer metadata once per distinct header
set. The
``Consumer`` keeps everything else: membership, rebalance callbacks, commits, seeks, pauses; its
queue carries only events, served by ``consume`` on the fetch thread as before.

The handle is the ``rd_kafka_t`` pointer that confluent-kafka's consumer object holds first after
its object header, in the librdkafka it loaded (looked up in the process's mappings); the handle
must be a consumer whose name begins with the consumer's ``client.id``, or the fetch is not used.
That layout is confluent-kafka's own, not a published interface, so the fetch is used only on the
releases it was tested on (``KNOWN_RELEASES``): ``confluent_kafka.version()`` and
``confluent_kafka.libversion()`` (the librdkafka it loaded, bundled or the system's) both from
2.6.1 up to and including every 2.16 patch release (``pyproject.toml`` names the tested releases).
On any other release the fetcher uses ``consume()``, and says so once at INFO.

``open_native_fetch`` returns None whenever anything does not match (another release, another
platform, another build of confluent-kafka), or when ``ORDERING_LAYER_NATIVE_FETCH=0`` is set, and
the fetcher then uses ``consume()``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
from collections.abc import Callable
from typing import Any

import confluent_kafka
from confluent_kafka import Consumer

from ordering_layer._core import NativeFetch
from ordering_layer.record import HeaderPairs, RecordMetadata, read_metadata
from ordering_layer.subscriber.fetched import read_headers
from ordering_layer.subscriber.records import Record

_LOGGER = logging.getLogger(__name__)

_HANDLE_OFFSET = 2 * ctypes.sizeof(ctypes.c_void_p)  # after ob_refcnt and ob_type
DEFAULT_CLIENT_ID = "rdkafka"  # librdkafka's default client.id

Malformed = Callable[[Record], None]

# The releases of confluent-kafka and of librdkafka the native fetch was tested on
# (tests/integration/test_native_fetch.py, tests/compat/check_versions.sh): from the lowest release
# to every patch release of the highest minor.
KNOWN_RELEASES: tuple[tuple[int, int, int], tuple[int, int]] = ((2, 6, 1), (2, 16))

_RELEASE = re.compile(r"(\d+)\.(\d+)\.(\d+)")


def is_known_release(version: str) -> bool:
    """Whether ``version`` (``major.minor.patch``, maybe with a suffix) is in ``KNOWN_RELEASES``."""
    match = _RELEASE.match(version)
    if match is None:
        return False
    lowest, highest_minor = KNOWN_RELEASES
    release = (int(match[1]), int(match[2]), int(match[3]))
    return lowest <= release and release[:2] <= highest_minor


@functools.cache
def unknown_release() -> str | None:
    """Why the loaded confluent-kafka or librdkafka is not a release the native fetch knows (logged
    at INFO, once per process), or None when both are.

    ``confluent_kafka.version()`` is a string (older releases: a (string, int) pair);
    ``libversion()`` a (string, int) pair.
    """
    reported: str | tuple[str, int] = confluent_kafka.version()
    loaded = {"confluent-kafka": reported if isinstance(reported, str) else reported[0],
              "librdkafka": confluent_kafka.libversion()[0]}
    for name, version in loaded.items():
        if not is_known_release(version):
            lowest, highest_minor = KNOWN_RELEASES
            reason = (f"{name} {version} is not a release the native fetch was tested on "
                      f"({'.'.join(map(str, lowest))} to {'.'.join(map(str, highest_minor))}.x)")
            _LOGGER.info("fetching through consume(): %s", reason)
            return reason
    return None


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


def header_metadata(malformed: Malformed, counted: Callable[[int], None] = lambda count: None,
                    ) -> Callable[[HeaderPairs, int, int], tuple[RecordMetadata, Any, bool]]:
    """``NativeFetch``'s ``metadata_of``: ``read_headers`` of a record's headers, with malformed
    metadata reported (DLQ-4) at the record's position, and each ``ol-partition-count`` read told to
    ``counted`` (once per distinct header set: a growth of the topic, SUB-8)."""

    def metadata_of(headers: HeaderPairs, partition: int, offset: int) -> tuple[RecordMetadata, Any, bool]:
        metadata, kept, shareable = read_headers(headers)
        if metadata.malformed is not None:
            malformed(Record(partition, offset, None, None, headers, metadata, 0, 0))
        if metadata.partition_count is not None:
            counted(metadata.partition_count)
        return metadata, kept, shareable

    return metadata_of


def open_native_fetch(consumer: Consumer, config: dict[str, Any], topic: str, malformed: Malformed,
                      counted: Callable[[int], None] = lambda count: None) -> NativeFetch | None:
    """A ``NativeFetch`` on ``consumer``, or None when it cannot be used here (logged) or is switched
    off (``ORDERING_LAYER_NATIVE_FETCH=0`` in the environment)."""
    if os.environ.get("ORDERING_LAYER_NATIVE_FETCH", "1") == "0" or unknown_release() is not None:
        return None
    library = loaded_librdkafka()
    if library is None or type(consumer) is not Consumer:
        _LOGGER.info("fetching through consume(): no librdkafka mapping or not a plain Consumer")
        return None
    handle = ctypes.c_void_p.from_address(id(consumer) + _HANDLE_OFFSET).value
    prefix = f"{config.get('client.id', DEFAULT_CLIENT_ID)}#consumer-"
    try:
        return NativeFetch(consumer, handle or 0, library, prefix, topic, header_metadata(malformed, counted),
                           read_metadata(None))
    except RuntimeError as exc:
        _LOGGER.info("fetching through consume(): %s", exc)
        return None
