"""Per-key order across a partition expansion while subscribers run (SUB-8)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from ordering_layer import Admin, Message, OrderedProducer, Subscriber
from tests.checker import DeliveryChecker, wait_until
from tests.integration.conftest import recording_callback

pytestmark = pytest.mark.integration


def publish_round(kafka_config: dict[str, Any], topic: str, keys: list[str], per_key: int, round_: int,
                  ids: dict[str, list[str]]) -> None:
    """Publish ``per_key`` messages of every key, interleaved, with a producer of its own (which
    reads the topic's partition count when it starts); their ids join ``ids`` in publish order."""
    with OrderedProducer(kafka_config) as producer:
        futures = [(key, producer.publish(topic, f"{key}:{round_}:{n}".encode(), ordering_key=key))
                   for n in range(per_key) for key in keys]
        for key, future in futures:
            ids[key].append(future.result(timeout=60).message_id)


def slow_ack(delay: float) -> Callable[[Message], str]:
    def handler(message: Message) -> str:
        time.sleep(delay)  # the handler's work, not a synchronisation
        return "ack"

    return handler


def test_order_holds_when_the_topic_grows_under_a_running_subscriber(
        admin: Admin, kafka_config: dict[str, Any], endpoints: Any,
        subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-8: 100 keys x 40 messages on 2 partitions, a subscriber working through them with a 40 ms
    handler; the topic grows to 6, a fresh producer sends 40 more per key (most keys move to another
    partition), a second subscriber joins. Every key is still delivered in order, one message
    outstanding at a time, across both subscribers."""
    topic, name = subscription(partitions=2)
    keys = [f"key-{k}" for k in range(100)]
    ids: dict[str, list[str]] = {key: [] for key in keys}
    publish_round(kafka_config, topic, keys, 40, 0, ids)
    checker = DeliveryChecker()
    for key in keys:
        checker.expect(key, ids[key])
    first = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    second = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with first.subscribe(name, recording_callback(checker, "s1", slow_ack(0.04)), max_workers=10):
        wait_until(lambda: checker.acked_count() >= 400, 60, "the first subscriber under way")
        admin.add_partitions(topic, 6)
        publish_round(kafka_config, topic, keys, 40, 1, ids)
        for key in keys:
            checker.expect(key, ids[key])
        with second.subscribe(name, recording_callback(checker, "s2", slow_ack(0.04)), max_workers=10):
            wait_until(lambda: checker.acked_count() == checker.total(), 240, "every message acked")
    assert checker.verify() == []
