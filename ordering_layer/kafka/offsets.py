"""Where a subscription stands in each partition, as Kafka records it: committed offset and log end.

One reading serves ``Admin.describe_subscription`` and the metrics collector's backlog gauge.
``retrying`` rides out the errors a new topic or a moving partition leader cause for a while.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NamedTuple, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

_LOGGER = logging.getLogger(__name__)

RETRIABLE = frozenset({
    KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError._TIMED_OUT})

_T = TypeVar("_T")


def retrying(call: Callable[[], _T], timeout: float = 30.0) -> _T:
    """Run a Kafka call, retrying for up to ``timeout`` seconds the errors that a new topic, a moving
    partition leader or a loading group coordinator cause (``RETRIABLE``); others are raised at once.

    Raises:
        confluent_kafka.KafkaException: a non-retriable error, or a retriable one past the timeout.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except KafkaException as exc:
            error = exc.args[0]
            code = error.code() if isinstance(error, KafkaError) else None
            if code not in RETRIABLE or time.monotonic() > deadline:
                raise
            _LOGGER.debug("retrying a Kafka call: %s", error)
            time.sleep(0.1)


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
    committed = retrying(lambda: consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=timeout),
                         timeout)
    rows = []
    for tp in committed:
        low, high = watermarks(consumer, topic, tp.partition, timeout)
        rows.append(PartitionOffsets(tp.partition, tp.offset if tp.offset >= 0 else None, low, high))
    return rows


def watermarks(consumer: Consumer, topic: str, partition: int, timeout: float) -> tuple[int, int]:
    """The partition's (low, high) watermarks, retried while its leader moves (``retrying``)."""
    tp = TopicPartition(topic, partition)
    low, high = retrying(lambda: consumer.get_watermark_offsets(tp, timeout=timeout), timeout)
    return low, high


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
