"""The Spark reader and a subscriber agree on per-key order across a partition expansion (SPK-2, SUB-8)."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
from pyspark.sql import SparkSession

from ordering_layer import Admin, Message, OrderedProducer, Subscriber
from ordering_layer.kafka.partitioner import partition_for
from ordering_layer.spark import read_ordered, restore_order
from tests.checker import wait_until

pytestmark = [pytest.mark.spark, pytest.mark.integration]


def test_spark_restores_the_order_a_subscriber_delivers_on_a_grown_topic(
        spark: SparkSession, admin: Admin, kafka_config: dict[str, Any], endpoints: Any,
        unique_name: Callable[[str], str]) -> None:
    """SPK-2, SUB-8: 30 keys published over 2 partitions, the topic grown to 6 while a subscriber
    runs, 30 keys published again; the per-key order ``restore_order`` gives equals the order the
    subscriber delivered (and the publish order), for the keys that moved and those that did not."""
    topic, name = unique_name("grown"), unique_name("sub")
    admin.create_topic(topic, partitions=2)
    admin.create_subscription(name, topic=topic)
    keys = [f"key-{k}" for k in range(30)]
    published: dict[str, list[str]] = defaultdict(list)
    delivered: dict[str, list[str]] = defaultdict(list)
    lock = threading.Lock()

    def publish(round_: int) -> None:
        with OrderedProducer(kafka_config) as producer:
            futures = [(key, producer.publish(topic, f"{round_}:{n}".encode(), ordering_key=key))
                       for n in range(4) for key in keys]
            for key, future in futures:
                published[key].append(future.result(timeout=60).message_id)

    def callback(message: Message) -> None:
        with lock:
            delivered[message.ordering_key or ""].append(message.message_id)
        message.ack()

    publish(0)
    with Subscriber(kafka_config, redis_url=endpoints.redis_url).subscribe(name, callback, max_workers=4):
        admin.add_partitions(topic, 6)
        publish(1)
        wait_until(lambda: sum(len(ids) for ids in delivered.values()) == len(keys) * 8, 120, "every message")
    restored: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for row in restore_order(read_ordered(spark, topic, kafka_config["bootstrap.servers"])).collect():
        restored[row.ordering_key].append((row.key_sequence, row.message_id))
    spark_order = {key: [message_id for _, message_id in sorted(rows)] for key, rows in restored.items()}
    assert any(partition_for(key.encode(), 2) != partition_for(key.encode(), 6) for key in keys)
    for key in keys:
        assert spark_order[key] == dict(delivered)[key] == published[key], key
