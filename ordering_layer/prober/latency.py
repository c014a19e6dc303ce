"""End-to-end latency percentiles in bounded memory: a log-bucketed histogram (2 % resolution)."""

from __future__ import annotations

import math

_STEP = math.log(1.02)  # bucket i holds latencies in [1.02**i, 1.02**(i+1)) microseconds


class LatencyHistogram:
    """Counts latencies in buckets 2 % wide (about 1,000 buckets from 1 us to a day); keeps the max exactly."""

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self.count = 0
        self.max = 0.0

    def add(self, seconds: float) -> None:
        """Record one latency; a negative one (clock skew between hosts) counts as zero."""
        seconds = max(0.0, seconds)
        micros = seconds * 1e6
        bucket = int(math.log(micros) / _STEP) if micros >= 1.0 else -1
        self._counts[bucket] = self._counts.get(bucket, 0) + 1
        self.count += 1
        self.max = max(self.max, seconds)

    def percentile(self, percent: float) -> float | None:
        """The latency (seconds, upper edge of its bucket, at most the max) below which ``percent`` %
        of the samples lie; None when empty."""
        if not self.count:
            return None
        target = self.count * percent / 100.0
        seen = 0
        for bucket in sorted(self._counts):
            seen += self._counts[bucket]
            if seen >= target:
                upper = 1e-6 if bucket < 0 else math.exp((bucket + 1) * _STEP) / 1e6
                return min(upper, self.max)
        return self.max

    def summary(self) -> dict[str, float | int | None]:
        """``{"count", "p50_ms", "p90_ms", "p99_ms", "max_ms"}``."""
        def ms(value: float | None) -> float | None:
            return None if value is None else round(value * 1000, 3)

        return {"count": self.count, "p50_ms": ms(self.percentile(50)), "p90_ms": ms(self.percentile(90)),
                "p99_ms": ms(self.percentile(99)), "max_ms": ms(self.max) if self.count else None}
