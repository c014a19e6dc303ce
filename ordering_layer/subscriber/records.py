"""What the subscriber queues and hands out: a fetched ``Record`` and one hand-off of it, a ``Delivery``
(compiled, ``core/src/delivery.rs``; ``message.Message`` is the engine's). Records are made and read
by the compiled core (``core/src/partition.rs``) through their slots, by name (``_core.RECORD_FIELDS``).
A ``Delivery`` is ``Delivery(record, queue_key, token, attempt)``; its ``lease`` is its handle in the
engine's ``LeaseTable`` (``leases``) while it is outstanding there (0: not taken by one)."""

from __future__ import annotations

from dataclasses import dataclass

from ordering_layer._core import Delivery
from ordering_layer.record import HeaderPairs, RecordMetadata

__all__ = ["AWAITING_SEEK", "Delivery", "QueueKey", "Record"]

QueueKey = bytes | int  # a key's queue: its key bytes, or the record's offset when it has none (unordered)

AWAITING_SEEK = -1  # the generation of a partition state whose consumer has not sought yet


@dataclass(slots=True, eq=False)
class Record:
    """A fetched Kafka record, as fetched, and the layer metadata read from it once.

    ``headers`` are the record's header pairs (records with the same headers may share one
    immutable sequence: ``Message.headers()`` returns a list of its own).

    ``key`` is the ordering key as the record's bytes (None when absent or empty: unordered); keys
    are compared as bytes, so a key of any producer is an ordering key (PUB-7). ``suspect``: it was
    handed out by an earlier owner of the partition and not settled (maybe it crashed that owner),
    so a callback worker records the start of each of its deliveries in Redis before user code runs.
    ``quarantined``: a suspect charged two attempts or more; it goes out alone (the core's
    ``Quarantine``, ``core/src/key_queue.rs``).
    """

    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: HeaderPairs | None
    metadata: RecordMetadata
    size: int
    timestamp_ms: int
    attempts: int = 0
    last_error: str | None = None
    suspect: bool = False
    quarantined: bool = False
