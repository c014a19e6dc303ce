"""The metrics hook: one snapshot of an engine's counters, gauges and recent observations.

Counters are plain ints the components bump per batch or per settled message; gauges are read here,
under the engine's lock, at the reader's pace (a scrape every few seconds), never on the hot path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ordering_layer.subscriber.leases import LeaseTable
from ordering_layer.subscriber.owned_partition import OwnedPartition
from ordering_layer.subscriber.state_writer import StateWriter


def snapshot(counts: Mapping[str, int], partitions: Mapping[int, OwnedPartition], leases: LeaseTable,
             writer: StateWriter, *, dead_lettered: int, malformed: int, now: float) -> dict[str, Any]:
    """Counters (monotonic), gauges, per-partition gauges and the observations since the last call.

    Keys: ``delivered``, ``acked``, ``nacked``, ``redelivered`` (attempt > 1), ``dead_lettered``,
    ``lease_extensions``, ``lease_lapses``, ``malformed_records``; ``outstanding``, ``held_keys``
    (keys with something outstanding or backing off); ``partitions``: {partition: {"outstanding",
    "buffered", "held_keys", "moved_keys_held" (keys moved in by a growth and waiting, SUB-8),
    "oldest_unacked_seconds"}}; ``ack_latency_seconds`` and
    ``redis_flush_seconds``: the observations made since the previous call (drained).
    """
    per: dict[int, dict[str, Any]] = {
        number: {"outstanding": 0, "buffered": state.buffered, "held_keys": state.held_keys(),
                 "moved_keys_held": state.core.moved_holding, "oldest_unacked_seconds": 0.0}
        for number, state in partitions.items()}
    for number, (outstanding, oldest) in leases.per_partition(now).items():
        entry = per.get(number)
        if entry is not None:
            entry["outstanding"] = outstanding
            entry["oldest_unacked_seconds"] = oldest
    latencies, flushes = leases.take_latencies(), list(writer.flush_seconds)
    writer.flush_seconds.clear()
    return {**counts, "dead_lettered": dead_lettered, "lease_extensions": leases.extensions,
            "lease_lapses": leases.lapses, "malformed_records": malformed,
            "outstanding": leases.count, "held_keys": sum(e["held_keys"] for e in per.values()),
            "partitions": per, "ack_latency_seconds": latencies, "redis_flush_seconds": flushes}
