"""``Admin``: topics (and, with Redis, subscriptions) of the layer.

Topics are created with ``message.timestamp.type=LogAppendTime`` so that every record carries the
broker's enqueued time.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewPartitions, NewTopic  # type: ignore[attr-defined]

from ordering_layer.config import require_bootstrap
from ordering_layer.errors import ConfigError, TopicError, TopicExistsError

_LOGGER = logging.getLogger(__name__)

_TIMEOUT = 30.0


@dataclass(frozen=True)
class TopicDescription:
    """A topic as the broker describes it."""

    name: str
    partitions: int
    replication_factor: int
    config: dict[str, str]

    @property
    def timestamp_type(self) -> str:
        """``LogAppendTime`` for topics the layer created."""
        return self.config.get("message.timestamp.type", "")


class Admin:
    """Topic (and subscription) administration.

    Args:
        config: confluent-kafka settings; ``bootstrap.servers`` is required.
        redis_url: the Redis holding subscription state (needed for subscriptions only).
    """

    def __init__(self, config: Mapping[str, Any], *, redis_url: str | None = None) -> None:
        require_bootstrap(config)
        conf = dict(config)
        conf.setdefault("logger", logging.getLogger("ordering_layer.kafka.admin"))
        try:
            self._admin = AdminClient(conf)
        except KafkaException as exc:
            raise ConfigError(f"Kafka admin config refused: {exc.args[0]}") from exc
        self._config = conf
        self.redis_url = redis_url

    def _broker_count(self) -> int:
        return max(1, len(self._admin.list_topics(timeout=_TIMEOUT).brokers))

    def create_topic(self, name: str, partitions: int = 1, *, replication_factor: int | None = None,
                     config: Mapping[str, str] | None = None, exist_ok: bool = False) -> TopicDescription:
        """Create a topic with broker append time; return its description.

        Args:
            name: topic name.
            partitions: partition count (>= 1).
            replication_factor: defaults to min(3, brokers in the cluster).
            config: further topic settings (``message.timestamp.type`` is always LogAppendTime).
            exist_ok: return the existing topic instead of raising.

        Raises:
            TopicExistsError: it exists and ``exist_ok`` is false.
            TopicError: the broker refused it.
        """
        if partitions < 1:
            raise ConfigError(f"partitions must be >= 1, got {partitions}")
        settings = {**(config or {}), "message.timestamp.type": "LogAppendTime"}
        replication = replication_factor or min(3, self._broker_count())
        futures = self._admin.create_topics(
            [NewTopic(name, num_partitions=partitions, replication_factor=replication, config=settings)],
            operation_timeout=_TIMEOUT, request_timeout=_TIMEOUT)
        try:
            futures[name].result(timeout=_TIMEOUT)
        except KafkaException as exc:
            error = exc.args[0]
            if isinstance(error, KafkaError) and error.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                if exist_ok:
                    return self.describe_topic(name)
                raise TopicExistsError(f"topic {name!r} exists already", topic=name) from exc
            raise TopicError(f"creating topic {name!r} failed: {error}", topic=name) from exc
        return self.describe_topic(name)

    def describe_topic(self, name: str) -> TopicDescription:
        """Partitions, replication and the non-default config of a topic.

        Raises:
            TopicError: the topic does not exist or cannot be read.
        """
        metadata = self._admin.list_topics(name, timeout=_TIMEOUT)
        topic = metadata.topics.get(name)
        if topic is None or topic.error is not None:
            reason = topic.error.str() if topic is not None and topic.error else "unknown topic"
            raise TopicError(f"topic {name!r}: {reason}", topic=name)
        resource = ConfigResource(ConfigResource.Type.TOPIC, name)
        try:
            entries = self._admin.describe_configs([resource])[resource].result(timeout=_TIMEOUT)
        except KafkaException as exc:
            raise TopicError(f"describing topic {name!r} failed: {exc.args[0]}", topic=name) from exc
        config = {key: str(entry.value) for key, entry in entries.items() if entry.value is not None}
        replication = len(next(iter(topic.partitions.values())).replicas) if topic.partitions else 0
        return TopicDescription(name, len(topic.partitions), replication, config)

    def add_partitions(self, name: str, total: int) -> TopicDescription:
        """Raise a topic's partition count to ``total`` (keys may move; PUB-6 keeps order defined)."""
        futures = self._admin.create_partitions([NewPartitions(name, total)],
                                                operation_timeout=_TIMEOUT, request_timeout=_TIMEOUT)
        try:
            futures[name].result(timeout=_TIMEOUT)
        except KafkaException as exc:
            raise TopicError(f"adding partitions to {name!r} failed: {exc.args[0]}", topic=name) from exc
        return self.describe_topic(name)

    def delete_topic(self, name: str) -> None:
        """Delete a topic (ignores a topic that does not exist)."""
        futures = self._admin.delete_topics([name], operation_timeout=_TIMEOUT, request_timeout=_TIMEOUT)
        try:
            futures[name].result(timeout=_TIMEOUT)
        except KafkaException as exc:
            error = exc.args[0]
            if isinstance(error, KafkaError) and error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                return
            raise TopicError(f"deleting topic {name!r} failed: {error}", topic=name) from exc
