"""Where a subscription stands in each partition, as Kafka records it: committed offset and log end.

One reading serves ``Admin.describe_subscription`` and the metrics collector's backlog gauge.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from confluent_kafka import Consumer, TopicPartition

_LOGGER = logging.getLogger(__name__)


class PartitionOffsets(NamedTuple):
    """A subscription's committed offset (None: never committed) and the log's bounds in one partition."""

    partition: int
    committed: int | None
    low: int
    end: int

    @property
    def backlog(self) -> int:
        """Records from the committed offset (the log start when none) to the log end."""
        return max(0, self.end - (self.low if self.committed is None else max(self.committed, self.low)))


def partition_offsets(consumer: Consumer, topic: str, partitions: list[int], timeout: float) -> list[PartitionOffsets]:
    """Read committed offsets of ``consumer``'s group and each partition's watermarks.

    Args:
        consumer: a consumer whose ``group.id`` is the subscription (it need not have joined).
        topic: the subscription's topic.
        partitions: the partitions to read.
        timeout: seconds allowed for each Kafka request.

    Raises:
        confluent_kafka.KafkaException: the broker or group coordinator did not answer in time.
    """
    committed = consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=timeout)
    rows = []
    for tp in committed:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, tp.partition), timeout=timeout)
        rows.append(PartitionOffsets(tp.partition, tp.offset if tp.offset >= 0 else None, low, high))
    return rows


_SEEK_TAG = "ol-seek:"


def seek_tag(generation: int) -> str:
    """The metadata of a subscriber's offset commit: the seek generation its partition state
    follows (GRP-3), so that a report of a commit made before a seek is told apart from one after."""
    return f"{_SEEK_TAG}{generation}"


def tagged_generation(metadata: str | None) -> int | None:
    """The seek generation in a commit's metadata (``seek_tag``); None when it carries none."""
    if metadata and metadata.startswith(_SEEK_TAG) and metadata[len(_SEEK_TAG):].isdigit():
        return int(metadata[len(_SEEK_TAG):])
    return None
