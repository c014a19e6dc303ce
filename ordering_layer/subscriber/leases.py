"""Leases of outstanding deliveries: deadlines, p99 extension, lapses (ACK-1, ACK-2, ACK-3).

The engine keeps every delivery handed out and not yet settled in a ``LeaseTable`` (the compiled
``core/src/leases.rs``): its partition, owner epoch, offset, token and payload size, when it went
out, its deadline and when it is looked at next. A delivery is named by a *handle* that its
``Message`` carries (``Message._lease``); once the delivery is settled, given back or dropped with
its partition, the handle names nothing, so a late answer about it changes nothing (ACK-5). A run of
plain acks is settled in one call (``LeaseTable.ack_run``: the table and the partitions' cores,
no Python per message), and released deliveries are taken as outstanding by the core's release
itself (``PartitionCore.release_ready(leases=...)``).

A due-time heap holds one watch per released batch (its deliveries share their deadline) and one
entry per lease watched alone since (a new deadline, an extension); shortly before a deadline the
lease is extended by the p99 ack latency (a histogram of whole seconds, 10..600, as Pub/Sub's
client keeps), clamped to the subscription's per-extension bounds, unless it has been held for
``max_lease_duration``; at the deadline it lapses and the coordinator gives the delivery back
(SUB-4). The table only keeps the books: the coordinator writes what it returns to Redis.

A delivery's lease reaches Redis (ACK-4) only if the delivery is still outstanding
``flushes.LEASE_WRITE_AGE`` after its release (``write_leases``, called by ``flushes`` as each
flush begins): most deliveries are settled sooner, and their settle deletes no lease (``ack_run``
queues a ``SETTLED`` op with bit 1 of its value set). An extension or a manual deadline writes the
lease itself.

With ``track=False`` (a comparison setting, not for production) no deadline is watched: leases
neither lapse nor get extended, and the release asks for no lease write.
"""

from __future__ import annotations

import time

from ordering_layer._core import LeaseTable
from ordering_layer.config import SubscriptionSettings

__all__ = ["LeaseTable", "lease_table", "wall_ms"]


def lease_table(settings: SubscriptionSettings, *, track: bool = True) -> LeaseTable:
    """An empty table for a subscription's lease settings."""
    return LeaseTable(ack_deadline=settings.ack_deadline, max_lease_duration=settings.max_lease_duration,
                      min_extension=settings.min_duration_per_lease_extension,
                      max_extension=settings.max_duration_per_lease_extension, track=track)


def wall_ms(seconds: float) -> int:
    """Epoch milliseconds ``seconds`` from now (what Redis stores as a deadline)."""
    return int((time.time() + seconds) * 1000)
