"""Kafka's default key partitioner (murmur2, as the Java client and librdkafka's murmur2_random).

The layer routes keyed records itself so that the partition count it stamps into each record
(PUB-6) is exactly the one that chose the partition.
"""

from __future__ import annotations

from functools import lru_cache

_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Kafka's ``Utils.murmur2`` as an unsigned 32-bit value."""
    length = len(data)
    h = (0x9747B28C ^ length) & _MASK
    body = length - length % 4
    for i in range(0, body, 4):
        k = int.from_bytes(data[i:i + 4], "little")
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    tail = length % 4
    if tail == 3:
        h ^= data[body + 2] << 16
    if tail >= 2:
        h ^= data[body + 1] << 8
    if tail >= 1:
        h ^= data[body]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h


@lru_cache(maxsize=131_072)
def partition_for(key: bytes, partition_count: int) -> int:
    """The partition Kafka's default partitioner picks for ``key`` among ``partition_count``."""
    return (murmur2(key) & 0x7FFFFFFF) % partition_count
