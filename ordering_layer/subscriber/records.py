"""What the subscriber queues and hands out: a fetched ``Record`` and one hand-off of it, a ``Delivery``
(``message.Message`` is the engine's). Both are compiled: ``Record`` in ``core/src/record.rs`` (its
numbers kept as Rust values, its fetched value made into ``bytes`` when read), ``Delivery`` in
``core/src/delivery.rs``. A ``Record`` is ``Record(partition, offset, key, value, headers, metadata,
size, timestamp_ms, attempts=0, last_error=None, suspect=False, quarantined=False)``; a ``Delivery``
is ``Delivery(record, queue_key, token, attempt)``, and its ``lease`` is its handle in the engine's
``LeaseTable`` (``leases``) while it is outstanding there (0: not taken by one)."""

from __future__ import annotations

from ordering_layer._core import Delivery, Record

__all__ = ["AWAITING_SEEK", "Delivery", "QueueKey", "Record"]

QueueKey = bytes | int  # a key's queue: its key bytes, or the record's offset when it has none (unordered)

AWAITING_SEEK = -1  # the generation of a partition state whose consumer has not sought yet
