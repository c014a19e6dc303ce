"""Kafka's murmur2 partitioner, against the Java client's own test vectors."""

from __future__ import annotations

import pytest

from ordering_layer.kafka.partitioner import murmur2, partition_for


def _signed(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value


@pytest.mark.parametrize(("key", "expected"), [
    ("21", -973932308),
    ("foobar", -790332482),
    ("a-little-bit-long-string", -985981536),
    ("a-little-bit-longer-string", -1486304829),
    ("lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
    ("abc", 479470107),
])
def test_murmur2_matches_kafka(key: str, expected: int) -> None:
    """PUB-1: keys route like Kafka's default partitioner (Utils.murmur2 vectors)."""
    assert _signed(murmur2(key.encode())) == expected


def test_partition_for_is_positive_modulo() -> None:
    """PUB-1: the partition is toPositive(murmur2) % count, stable for a key."""
    for count in (1, 3, 6, 7):
        for i in range(200):
            key = f"key-{i}".encode()
            assert partition_for(key, count) == (murmur2(key) & 0x7FFFFFFF) % count
            assert 0 <= partition_for(key, count) < count
