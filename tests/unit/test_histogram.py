"""ACK-2: the ack latency histogram and the extension arithmetic."""

from __future__ import annotations

from ordering_layer.subscriber.histogram import Histogram, extension_seconds


def test_empty_histogram_extends_by_ten_seconds() -> None:
    """ACK-2: with no samples the extension is the 10 s minimum."""
    assert extension_seconds(Histogram(), min_extension=0, max_extension=0) == 10


def test_p99_of_whole_seconds_clamped_to_10_600() -> None:
    """ACK-2: latencies count in whole seconds within 10..600; p99 picks the bucket."""
    histogram = Histogram()
    for _ in range(98):
        histogram.add(0.2)
    histogram.add(42.1)
    histogram.add(5000)
    assert len(histogram) == 100
    assert histogram.percentile(50) == 10
    assert histogram.percentile(99) == 43
    assert histogram.percentile(100) == 600
    assert extension_seconds(histogram, min_extension=0, max_extension=0) == 43


def test_extension_clamped_to_subscription_bounds() -> None:
    """ACK-2: min/max_duration_per_lease_extension clamp the p99 (0 means unset)."""
    histogram = Histogram()
    for _ in range(100):
        histogram.add(100)
    assert extension_seconds(histogram, min_extension=0, max_extension=0) == 100
    assert extension_seconds(histogram, min_extension=0, max_extension=30) == 30
    assert extension_seconds(histogram, min_extension=200, max_extension=0) == 200
    fast = Histogram()
    fast.add(1)
    assert extension_seconds(fast, min_extension=20, max_extension=0) == 20
