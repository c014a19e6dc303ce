"""Marks of keys that left a partition in an expansion and were cleared (SUB-8), kept durably.

A key moved from its old partition p to q is released in q once every record of it in p published
under an earlier count is settled. From then on, q hands out the key's later records; if p's owner
lost its settled set (a Redis FLUSHALL, a Redis that restarted empty), it would replay the key's old
records from the group's commit point, after the later ones went out (SUB-4 across partitions). So
the guard that clears a key first writes a mark for each old partition: ``(key, count, below)``,
every record of the key in p at an offset below ``below`` published under a count below ``count``
is settled. A new owner of p takes the marks and skips those records at intake
(``PartitionCore.set_departed``).

The marks live in Redis, a hash per subscription and partition (``departed_key``), and in a durable
copy, a record per mark in the compacted topic ``DEPARTED_TOPIC``, written first. A sentinel key
(``restored_key``) says that Redis has them all; when it is missing, they are read back from the
durable copy before any is read or written. A mark carries the subscription's seek generation when
it was written: a seek makes the records it rewinds over unsettled, so a claim under a later seek
generation ignores older marks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ordering_layer.kafka.compacted import CompactedTopic

_LOGGER = logging.getLogger(__name__)

DEPARTED_TOPIC = "__ordering_layer_departed_keys"


@dataclass(frozen=True)
class Departed:
    """A key's records in ``partition`` at offsets below ``below``, published under a count below
    ``count``, are settled (marked under seek generation ``seek_generation``)."""

    partition: int
    key: bytes
    count: int
    below: int
    seek_generation: int


def departed_key(subscription: str, partition: int) -> str:
    """The Redis hash of a partition's marks: key (hex) -> "count below seek_generation"."""
    return f"ol:departed:{{{subscription}}}:{partition}"


def restored_key(subscription: str) -> str:
    """The Redis key whose presence says that Redis holds every mark of the subscription."""
    return f"ol:departed:{{{subscription}}}:restored"


def _encode(mark: Departed) -> str:
    return f"{mark.count} {mark.below} {mark.seek_generation}"


def _decode(partition: int, key_hex: str, value: str) -> Departed | None:
    try:
        count, below, generation = (int(part) for part in value.split())
        return Departed(partition, bytes.fromhex(key_hex), count, below, generation)
    except ValueError:
        _LOGGER.warning("a departed-key mark that cannot be read was ignored (%s: %r)", key_hex, value)
        return None


class DepartedKeys:
    """Reads and writes one subscription's departed-key marks.

    Args:
        client: the layer's Redis client.
        kafka_config: connection settings of the layer's cluster (the durable copy).
        subscription: the subscription.
    """

    def __init__(self, client: Any, kafka_config: Mapping[str, Any], subscription: str) -> None:
        self._client = client
        self._subscription = subscription
        self._durable = CompactedTopic(kafka_config, DEPARTED_TOPIC, "departed-keys")
        self._lock = threading.Lock()

    def _name(self, mark: Departed) -> str:
        return f"{self._subscription}/{mark.partition}/{mark.key.hex()}"

    def _restore(self) -> None:
        """Read the marks back from the durable copy when Redis lost them (the sentinel is gone).

        Raises:
            redis.RedisError, TopicError: Redis or the durable copy could not be read or written.
        """
        with self._lock:
            if self._client.exists(restored_key(self._subscription)):
                return
            prefix = f"{self._subscription}/"
            kept: dict[int, dict[str, str]] = {}
            for name, value in self._durable.read_all().items():
                if not name.startswith(prefix):
                    continue
                number, _, key_hex = name[len(prefix):].partition("/")
                if number.isdigit() and key_hex:
                    kept.setdefault(int(number), {})[key_hex] = value.decode()
            pipe = self._client.pipeline(transaction=False)
            for partition, marks in kept.items():
                pipe.hset(departed_key(self._subscription, partition), mapping=marks)
            pipe.set(restored_key(self._subscription), 1)
            pipe.execute()
            if kept:
                _LOGGER.warning("%s: %d departed-key marks missing in Redis: restored from their durable copy",
                                self._subscription, sum(len(marks) for marks in kept.values()))

    def prepare(self) -> None:
        """Make the durable copy's topic and writer, and restore Redis if it lost the marks, ahead
        of the first ``record``.

        Raises:
            redis.RedisError, OrderingLayerError: Redis or the durable copy failed.
        """
        self._durable.prepare()
        self._restore()

    def record(self, marks: Iterable[Departed]) -> None:
        """Write marks, durably first (a mark is written only when it raises what is kept).

        Raises:
            redis.RedisError: Redis did not answer.
            PublishError, TopicError: the durable copy could not be written.
        """
        marks = list(marks)
        if not marks:
            return
        self._restore()
        self._durable.send([(self._name(mark), _encode(mark).encode()) for mark in marks])
        pipe = self._client.pipeline(transaction=False)
        for mark in marks:
            pipe.hset(departed_key(self._subscription, mark.partition), mark.key.hex(), _encode(mark))
        pipe.execute()

    def for_partition(self, partition: int) -> list[Departed]:
        """The marks of ``partition`` (the claim keeps those of its seek generation or later).

        Raises:
            redis.RedisError, TopicError: Redis or the durable copy could not be read.
        """
        self._restore()
        raw = self._client.hgetall(departed_key(self._subscription, partition))
        marks = []
        for key_hex, value in raw.items():
            text = key_hex.decode() if isinstance(key_hex, bytes) else key_hex
            mark = _decode(partition, text, value.decode() if isinstance(value, bytes) else value)
            if mark is not None:
                marks.append(mark)
        return marks

    def close(self) -> None:
        """Flush the durable copy's writes in flight."""
        self._durable.close()
