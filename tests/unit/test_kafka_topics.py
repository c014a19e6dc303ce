"""``Topics.describe`` while a new topic's metadata reaches the brokers (no Kafka needed)."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any, cast

import pytest
from confluent_kafka import KafkaError
from confluent_kafka.admin import AdminClient

from ordering_layer.errors import TopicError
from ordering_layer.kafka.topics import Topics
from ordering_layer.subscriptions import METADATA_SETTLE


class MetadataAnswers:
    """An admin client whose metadata does not know the topic for the first ``unknown`` answers."""

    def __init__(self, unknown: int) -> None:
        self.unknown = unknown
        self.asked = 0

    def list_topics(self, name: str, timeout: float) -> Any:
        self.asked += 1
        if self.asked <= self.unknown:
            error = KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)
            return SimpleNamespace(topics={name: SimpleNamespace(error=error, partitions={})})
        partition = SimpleNamespace(replicas=[1, 2, 3], leader=1, error=None)
        return SimpleNamespace(topics={name: SimpleNamespace(error=None, partitions={0: partition, 1: partition})})

    def describe_configs(self, resources: list[Any]) -> dict[Any, Future[dict[str, Any]]]:
        future: Future[dict[str, Any]] = Future()
        future.set_result({"cleanup.policy": SimpleNamespace(value="delete")})
        return {resources[0]: future}


def test_a_topic_unknown_for_a_moment_to_the_broker_asked_is_described_once_known() -> None:
    """A topic just created may be unknown for a moment to the broker answering (another broker of
    the cluster): with ``settle`` it is asked about again (``create_subscription`` does so, right
    after a ``create_topic`` maybe); without, the first answer stands (``ensure_topic`` of the
    compacted topics creates a topic it is told is missing, at once)."""
    answers = MetadataAnswers(unknown=3)
    topics = Topics({}, client=cast(AdminClient, answers))
    with pytest.raises(TopicError, match="fresh"):
        topics.describe("fresh")
    assert answers.asked == 1
    described = topics.describe("fresh", settle=METADATA_SETTLE)
    assert (described.partitions, described.replication_factor, described.partitions_with_leader) == (2, 3, 2)
    assert answers.asked == 4


def test_a_topic_that_stays_unknown_raises_after_the_settle_time() -> None:
    """A topic that does not exist is still a ``TopicError``, once the settle time passed."""
    answers = MetadataAnswers(unknown=10**6)
    topics = Topics({}, client=cast(AdminClient, answers))
    with pytest.raises(TopicError, match="missing"):
        topics.describe("missing", settle=0.3)
    assert answers.asked >= 2
