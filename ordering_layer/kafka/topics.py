"""``Topics``: create, describe, grow and delete Kafka topics.

Topics the layer creates take the broker's append time (``message.timestamp.type=LogAppendTime``),
which a message's ``publish_time`` is. ``Admin`` offers these calls to users; the compacted topics
of the layer's own records and the creation of a subscription use them without the admin facade.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewPartitions, NewTopic  # type: ignore[attr-defined]

from ordering_layer.errors import ConfigError, TopicError, TopicExistsError
from ordering_layer.kafka_config import connection_settings

_TIMEOUT = 30.0


@dataclass(frozen=True)
class TopicDescription:
    """A topic as the broker describes it."""

    name: str
    partitions: int
    replication_factor: int
    config: dict[str, str]
    partitions_with_leader: int = 0

    @property
    def timestamp_type(self) -> str:
        """``LogAppendTime`` for topics the layer created."""
        return self.config.get("message.timestamp.type", "")


class Topics:
    """Topic calls on one Kafka admin client.

    Args:
        kafka_config: confluent-kafka settings; only their ``connection_settings`` are used.
        client: an admin client to share (made from ``kafka_config`` otherwise).

    Raises:
        ConfigError: confluent-kafka refuses the config.
    """

    def __init__(self, kafka_config: Mapping[str, Any], client: AdminClient | None = None) -> None:
        if client is None:
            conf = connection_settings(kafka_config)
            conf.setdefault("logger", logging.getLogger("ordering_layer.kafka.admin"))
            try:
                client = AdminClient(conf)
            except KafkaException as exc:
                raise ConfigError(f"Kafka admin config refused: {exc.args[0]}") from exc
        self.client = client

    def _broker_count(self) -> int:
        return max(1, len(self.client.list_topics(timeout=_TIMEOUT).brokers))

    def create(self, name: str, partitions: int = 1, *, replication_factor: int | None = None,
               config: Mapping[str, str] | None = None, exist_ok: bool = False) -> TopicDescription:
        """Create a topic with broker append time; return its description.

        Args:
            name: topic name.
            partitions: partition count (>= 1).
            replication_factor: defaults to min(3, brokers in the cluster).
            config: further topic settings (``message.timestamp.type`` is always LogAppendTime;
                with 3 or more replicas ``min.insync.replicas`` defaults to 2, so an acked publish
                is on two brokers and one broker can fail without stopping writes).
            exist_ok: return the existing topic instead of raising.

        Raises:
            TopicExistsError: it exists and ``exist_ok`` is false.
            TopicError: the broker refused it.
        """
        if partitions < 1:
            raise ConfigError(f"partitions must be >= 1, got {partitions}")
        settings = {**(config or {}), "message.timestamp.type": "LogAppendTime"}
        replication = replication_factor or min(3, self._broker_count())
        if replication >= 3:
            settings.setdefault("min.insync.replicas", "2")
        futures = self.client.create_topics(
            [NewTopic(name, num_partitions=partitions, replication_factor=replication, config=settings)],
            operation_timeout=_TIMEOUT, request_timeout=_TIMEOUT)
        try:
            futures[name].result(timeout=_TIMEOUT)
        except KafkaException as exc:
            error = exc.args[0]
            if isinstance(error, KafkaError) and error.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                if exist_ok:
                    # Created by a concurrent caller: the broker answering may not show it yet.
                    return self.wait_for(name)
                raise TopicExistsError(f"topic {name!r} exists already", topic=name) from exc
            raise TopicError(f"creating topic {name!r} failed: {error}", topic=name) from exc
        return self.wait_for(name, partitions)

    def wait_for(self, name: str, partitions: int | None = None) -> TopicDescription:
        """The topic's description once metadata shows ``partitions`` partitions (default: as many as
        it has, at least one), each with a leader; creation is asynchronous."""
        deadline = time.monotonic() + _TIMEOUT
        while True:
            try:
                described = self.describe(name)
                wanted = max(1, described.partitions) if partitions is None else partitions
                if described.partitions >= wanted and described.partitions_with_leader >= wanted:
                    return described
            except TopicError:
                if time.monotonic() > deadline:
                    raise
            if time.monotonic() > deadline:
                return described
            time.sleep(0.05)

    def describe(self, name: str, *, settle: float = 0.0) -> TopicDescription:
        """Partitions, replication and the non-default config of a topic.

        Args:
            name: the topic.
            settle: seconds to ask again while the broker asked does not know the topic (in a
                cluster, a topic created moments ago may be unknown for a moment to some brokers).

        Raises:
            TopicError: the topic does not exist (after ``settle``) or cannot be read.
        """
        settle_until = time.monotonic() + settle
        while True:
            metadata = self.client.list_topics(name, timeout=_TIMEOUT)
            topic = metadata.topics.get(name)
            if topic is not None and topic.error is None:
                break
            if time.monotonic() >= settle_until:
                reason = topic.error.str() if topic is not None and topic.error else "unknown topic"
                raise TopicError(f"topic {name!r}: {reason}", topic=name)
            time.sleep(0.1)
        resource = ConfigResource(ConfigResource.Type.TOPIC, name)
        try:
            entries = self.client.describe_configs([resource])[resource].result(timeout=_TIMEOUT)
        except KafkaException as exc:
            raise TopicError(f"describing topic {name!r} failed: {exc.args[0]}", topic=name) from exc
        config = {key: str(entry.value) for key, entry in entries.items() if entry.value is not None}
        replication = len(next(iter(topic.partitions.values())).replicas) if topic.partitions else 0
        led = sum(1 for p in topic.partitions.values() if p.leader >= 0 and p.error is None)
        return TopicDescription(name, len(topic.partitions), replication, config, led)

    def add_partitions(self, name: str, total: int) -> None:
        """Raise a topic's partition count to ``total`` (the new partitions may still lack leaders).

        Raises:
            TopicError: the broker refused (for example ``total`` is not above the current count).
        """
        futures = self.client.create_partitions([NewPartitions(name, total)],
                                                operation_timeout=_TIMEOUT, request_timeout=_TIMEOUT)
        try:
            futures[name].result(timeout=_TIMEOUT)
        except KafkaException as exc:
            raise TopicError(f"adding partitions to {name!r} failed: {exc.args[0]}", topic=name) from exc

    def delete(self, name: str) -> None:
        """Delete a topic (ignores a topic that does not exist)."""
        futures = self.client.delete_topics([name], operation_timeout=_TIMEOUT, request_timeout=_TIMEOUT)
        try:
            futures[name].result(timeout=_TIMEOUT)
        except KafkaException as exc:
            error = exc.args[0]
            if isinstance(error, KafkaError) and error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                return
            raise TopicError(f"deleting topic {name!r} failed: {error}", topic=name) from exc
