"""Fixtures and helpers shared by the integration tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from ordering_layer import Admin, Message, OrderedProducer, RetryPolicy
from ordering_layer.stack import Endpoints
from tests.checker import DeliveryChecker

NO_BACKOFF = RetryPolicy(minimum_backoff=0, maximum_backoff=0)


def cli_servers(endpoints: Endpoints) -> list[str]:
    """The CLI's server options for ``endpoints``: the bootstrap address, the Kafka client settings
    file when the stack has one (TLS, SASL), and the Redis URL."""
    kafka_config = ["--kafka-config", endpoints.kafka_config_file] if endpoints.kafka_config_file else []
    return ["--bootstrap", endpoints.bootstrap, *kafka_config, "--redis-url", endpoints.redis_url]


def publish_keys(kafka_config: dict[str, Any], topic: str, keys: int, per_key: int,
                 checker: DeliveryChecker | None = None, prefix: str = "key") -> DeliveryChecker:
    """Publish ``per_key`` messages for each of ``keys`` keys, interleaved; declare them to a checker."""
    checker = checker or DeliveryChecker()
    ids: dict[str, list[str]] = {f"{prefix}-{k}": [] for k in range(keys)}
    with OrderedProducer(kafka_config) as producer:
        futures = [(key, producer.publish(topic, f"{key}:{n}".encode(), ordering_key=key))
                   for n in range(per_key) for key in ids]
        for key, future in futures:
            ids[key].append(future.result(timeout=60).message_id)
    for key, message_ids in ids.items():
        checker.expect(key, message_ids)
    return checker


@pytest.fixture
def subscription(admin: Admin, topic_factory: Callable[..., str],
                 unique_name: Callable[[str], str]) -> Callable[..., tuple[str, str]]:
    """Creates a topic and a subscription of it; returns (topic, subscription)."""

    def create(partitions: int = 3, **settings: Any) -> tuple[str, str]:
        topic = topic_factory(partitions=partitions)
        name = unique_name("sub")
        settings.setdefault("retry_policy", NO_BACKOFF)
        admin.create_subscription(name, topic=topic, **settings)
        return topic, name

    return create


def recording_callback(checker: DeliveryChecker, subscriber: str,
                       handler: Callable[[Message], str] | None = None) -> Callable[[Message], None]:
    """A callback that records each delivery and what the handler decided (ack by default)."""

    def callback(message: Message) -> None:
        checker.record(message.message_id, subscriber, message.delivery_attempt, "deliver")
        action = handler(message) if handler else "ack"
        checker.record(message.message_id, subscriber, message.delivery_attempt, action)
        if action == "ack":
            message.ack()
        else:
            message.nack()

    return callback




def pull_until(subscriber: Any, subscription: str, count: int, timeout: float = 30.0,
               ack: bool = False) -> list[Message]:
    """Pull until ``count`` messages came (acking each batch when ``ack``); fail after ``timeout``."""
    got: list[Message] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"pulled {len(got)} of {count} messages in {timeout:.0f} s")
        batch = subscriber.pull(subscription, max_messages=100, timeout=0.5)
        if ack:
            for message in batch:
                message.ack()
        got.extend(batch)
    return got
