"""The engine's consumer settings and the settings its other clients take."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from ordering_layer.config import FlowControl, SubscriptionSettings
from ordering_layer.state import StateStore
from ordering_layer.subscriber import fetcher
from ordering_layer.subscriber.client_config import (
    FETCH_QUEUE_BACKOFF_MS,
    consumer_settings,
)
from ordering_layer.subscriber.engine import Engine


def test_consumer_settings_fix_the_group_commits_and_assignor() -> None:
    conf = consumer_settings({"bootstrap.servers": "b:9092", "group.id": "theirs", "enable.auto.commit": True},
                             "orders-sub")
    assert conf["bootstrap.servers"] == "b:9092"
    assert conf["group.id"] == "orders-sub"
    assert conf["enable.auto.commit"] is False
    assert conf["enable.auto.offset.store"] is False
    assert conf["partition.assignment.strategy"] == "cooperative-sticky"


def test_fetch_queue_backoff_defaults_short_and_the_users_value_wins() -> None:
    assert consumer_settings({"bootstrap.servers": "b"}, "s")["fetch.queue.backoff.ms"] == FETCH_QUEUE_BACKOFF_MS
    assert FETCH_QUEUE_BACKOFF_MS < 1000  # librdkafka's default, which stalls a fast consumer for a second
    conf = consumer_settings({"bootstrap.servers": "b", "fetch.queue.backoff.ms": 500}, "s")
    assert conf["fetch.queue.backoff.ms"] == 500


def test_partition_fetch_bytes_default_small_and_the_users_value_wins() -> None:
    """A fetch response carries at most 256 KiB of each partition (librdkafka's default is 1 MiB),
    so a backlog's first partitions cannot fill the engine's buffer alone
    (``test_a_backlog_over_partitions_starts_every_key_at_once``)."""
    assert consumer_settings({"bootstrap.servers": "b"}, "s")["max.partition.fetch.bytes"] == 256 * 1024
    conf = consumer_settings({"bootstrap.servers": "b", "max.partition.fetch.bytes": 1 << 20}, "s")
    assert conf["max.partition.fetch.bytes"] == 1 << 20


def test_prefetch_is_split_over_the_topics_partitions_and_the_users_value_wins() -> None:
    """The native fetch keeps each partition's queue apart, so librdkafka's prefetch bound applies per
    partition: 64 MiB over the topic's partitions, at least 1 MiB each, 8 MiB each when the count is
    not known."""
    kbytes = {count: consumer_settings({"bootstrap.servers": "b"}, "s", count)["queued.max.messages.kbytes"]
              for count in (None, 1, 6, 64, 200)}
    assert kbytes == {None: 8192, 1: 65536, 6: 10922, 64: 1024, 200: 1024}
    conf = consumer_settings({"bootstrap.servers": "b", "queued.max.messages.kbytes": 7}, "s", 6)
    assert conf["queued.max.messages.kbytes"] == 7


def test_nested_topic_settings_cannot_move_the_engines_start() -> None:
    """DRP-2: ``default.topic.config`` is read before the engine sets its own start: a program's
    ``largest`` there cannot make the engine's consumer skip records it must recover."""
    conf = consumer_settings({"bootstrap.servers": "b", "default.topic.config": {"auto.offset.reset": "largest"}},
                             "s")
    assert "default.topic.config" not in conf
    assert conf["auto.offset.reset"] == "earliest"


def test_the_engine_builds_its_consumer_from_these_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's Kafka consumer is made with ``consumer_settings`` (the fetch backoff included)."""
    made: list[dict[str, Any]] = []

    class Recording:
        def __init__(self, conf: dict[str, Any]) -> None:
            made.append(conf)

    monkeypatch.setattr(fetcher, "Consumer", Recording)
    Engine({"bootstrap.servers": "127.0.0.1:1"}, cast(StateStore, SimpleNamespace(pipelines=False)), "orders-sub",
           SubscriptionSettings(topic="orders"), flow_control=FlowControl(), on_messages=None)
    [conf] = made
    assert conf["fetch.queue.backoff.ms"] == FETCH_QUEUE_BACKOFF_MS
    assert conf["group.id"] == "orders-sub"
    assert callable(conf["on_commit"])
