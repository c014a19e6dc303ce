"""Snapshots of a subscription's acked state (GRP-3), kept in a compacted topic of the layer's own
records (``schemas/snapshot.avsc``), keyed by snapshot name.

A snapshot holds, per partition, the committed offset and the offsets settled above it. It expires
``ttl`` seconds after it was taken: an expired snapshot is neither listed nor usable, and whoever
reads it writes its tombstone (compaction then drops it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ordering_layer.errors import ConfigError, RecordFormatError, SnapshotExistsError, SnapshotNotFoundError
from ordering_layer.kafka.compacted import CompactedTopic
from ordering_layer.record import decode, encode, now_ms

_LOGGER = logging.getLogger(__name__)

SCHEMA = "snapshot"
MAX_NAME_BYTES = 255


def check_name(name: str) -> None:
    """Refuse an empty snapshot name or one longer than 255 UTF-8 bytes (``ConfigError``)."""
    if not name or len(name.encode()) > MAX_NAME_BYTES or not name.isprintable():
        raise ConfigError(f"a snapshot name is 1..{MAX_NAME_BYTES} bytes of printable text, got {name!r}")


@dataclass(frozen=True)
class SnapshotPartition:
    """One partition's acked state: everything below ``committed`` and the ``settled`` offsets above it."""

    partition: int
    committed: int
    settled: tuple[int, ...] = ()


@dataclass(frozen=True)
class Snapshot:
    """A subscription's acked state at ``created_at`` (GRP-3)."""

    name: str
    subscription: str
    topic: str
    created_at_ms: int
    expire_at_ms: int
    partitions: tuple[SnapshotPartition, ...]

    @property
    def created_at(self) -> datetime:
        """When it was taken (UTC)."""
        return datetime.fromtimestamp(self.created_at_ms / 1000, UTC)

    @property
    def expire_at(self) -> datetime:
        """When it expires (UTC)."""
        return datetime.fromtimestamp(self.expire_at_ms / 1000, UTC)

    def expired(self, at_ms: int) -> bool:
        """True once ``at_ms`` (ms since the epoch) has reached the expiry."""
        return at_ms >= self.expire_at_ms

    @property
    def settled_above(self) -> int:
        """Offsets acked above the committed offsets, all partitions."""
        return sum(len(p.settled) for p in self.partitions)

    def encode(self) -> bytes:
        """The record as schemaless Avro."""
        return encode(SCHEMA, {
            "name": self.name, "subscription": self.subscription, "topic": self.topic,
            "created_at_ms": self.created_at_ms, "expire_at_ms": self.expire_at_ms,
            "partitions": [{"partition": p.partition, "committed": p.committed, "settled": list(p.settled)}
                           for p in self.partitions]})

    @staticmethod
    def decode(payload: bytes) -> Snapshot:
        """A record read back. Raises ``RecordFormatError`` when ``payload`` is not one."""
        raw = decode(SCHEMA, payload)
        return Snapshot(
            name=raw["name"], subscription=raw["subscription"], topic=raw["topic"],
            created_at_ms=raw["created_at_ms"], expire_at_ms=raw["expire_at_ms"],
            partitions=tuple(SnapshotPartition(p["partition"], p["committed"], tuple(p["settled"]))
                             for p in raw["partitions"]))


def live_snapshots(records: Mapping[str, bytes], at_ms: int) -> tuple[dict[str, Snapshot], list[str]]:
    """Split the snapshot topic's last values into the live snapshots (by name) and the names of
    the expired ones (to forget). Records that are not snapshots are skipped with a warning."""
    live: dict[str, Snapshot] = {}
    expired: list[str] = []
    for name, value in records.items():
        try:
            snapshot = Snapshot.decode(value)
        except RecordFormatError:
            _LOGGER.warning("snapshot topic: record of %r is not a Snapshot record", name)
            continue
        if snapshot.expired(at_ms):
            expired.append(name)
        else:
            live[name] = snapshot
    return live, expired


class SnapshotBook:
    """The snapshots of one snapshot topic.

    Args:
        kafka_config: confluent-kafka settings (``bootstrap.servers`` at least).
        topic: the compacted snapshot topic (created on first write).
    """

    def __init__(self, kafka_config: Mapping[str, Any], topic: str) -> None:
        self.log = CompactedTopic(kafka_config, topic, "snapshot")

    def _live(self) -> dict[str, Snapshot]:
        live, expired = live_snapshots(self.log.read_all(), now_ms())
        if expired:
            _LOGGER.info("snapshots expired, forgetting them: %s", ", ".join(sorted(expired)))
            self.log.send([(name, None) for name in expired])
        return live

    def add(self, snapshot: Snapshot) -> None:
        """Store a new snapshot.

        Raises:
            SnapshotExistsError: a live snapshot of that name exists.
            PublishError: the snapshot topic did not take the record.
        """
        if snapshot.name in self._live():
            raise SnapshotExistsError(snapshot.name)
        self.log.send([(snapshot.name, snapshot.encode())])

    def get(self, name: str) -> Snapshot:
        """The live snapshot ``name``. Raises ``SnapshotNotFoundError`` (also once it has expired)."""
        snapshot = self._live().get(name)
        if snapshot is None:
            raise SnapshotNotFoundError(name)
        return snapshot

    def list(self) -> list[Snapshot]:
        """The live snapshots, by name."""
        return sorted(self._live().values(), key=lambda s: s.name)

    def delete(self, name: str) -> None:
        """Delete a live snapshot (a tombstone). Raises ``SnapshotNotFoundError``."""
        self.get(name)
        self.log.send([(name, None)])

    def close(self) -> None:
        """Flush what is in flight."""
        self.log.close()
