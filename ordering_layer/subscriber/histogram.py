"""Ack latency histogram and the lease extension it implies (ACK-2).

As in Pub/Sub's client: latencies are counted in whole seconds, clamped to 10..600, and each lease
extension lasts the 99th percentile, clamped to the subscription's per-extension bounds.
"""

from __future__ import annotations

import math
import threading

MIN_EXTENSION = 10
MAX_EXTENSION = 600


class Histogram:
    """Counts of ack latencies in whole seconds (10..600)."""

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self._total = 0
        self._lock = threading.Lock()

    def add(self, seconds: float) -> None:
        """Record one ack latency."""
        self.add_many([seconds])

    def add_many(self, latencies: list[float]) -> None:
        """Record several ack latencies (one lock acquisition)."""
        with self._lock:
            counts = self._counts
            for seconds in latencies:
                bucket = MIN_EXTENSION if seconds <= MIN_EXTENSION else min(MAX_EXTENSION, math.ceil(seconds))
                counts[bucket] = counts.get(bucket, 0) + 1
            self._total += len(latencies)

    def __len__(self) -> int:
        return self._total

    def percentile(self, percent: float) -> int:
        """The smallest bucket with at least ``percent`` % of the samples at or below it (10 when empty)."""
        with self._lock:
            if not self._total:
                return MIN_EXTENSION
            target = self._total * percent / 100.0
            seen = 0
            for bucket in sorted(self._counts):
                seen += self._counts[bucket]
                if seen >= target:
                    return bucket
            return MAX_EXTENSION


def extension_seconds(histogram: Histogram, *, min_extension: float, max_extension: float) -> float:
    """Length of the next lease extension: p99 ack latency, clamped to the subscription's
    ``[min_duration_per_lease_extension, max_duration_per_lease_extension]`` (0 = unset) and to 10..600 s."""
    seconds = float(histogram.percentile(99))
    if min_extension:
        seconds = max(seconds, min_extension)
    if max_extension:
        seconds = min(seconds, max_extension)
    return min(float(MAX_EXTENSION), max(float(MIN_EXTENSION), seconds))
