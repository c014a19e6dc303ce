"""Kafka settings read as librdkafka reads them, and the settings the layer's own clients take (DRP-2)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from ordering_layer import OrderedConsumer, OrderedProducer
from ordering_layer.config import StartPosition
from ordering_layer.errors import ConfigError
from ordering_layer.kafka_config import (
    connection_settings,
    flag,
    integer,
    offset_reset,
    read_kafka_config,
)


def test_nested_topic_settings_join_the_top_level() -> None:
    """DRP-2: the old-style ``default.topic.config`` dict is read like top-level settings."""
    conf = read_kafka_config({"bootstrap.servers": "b", "group.id": "g",
                              "default.topic.config": {"auto.offset.reset": "smallest"}})
    assert conf == {"bootstrap.servers": "b", "group.id": "g", "auto.offset.reset": "smallest"}


def test_keyword_settings_override_the_dict() -> None:
    conf = read_kafka_config({"bootstrap.servers": "a", "linger.ms": 5}, {"bootstrap.servers": "b"})
    assert conf == {"bootstrap.servers": "b", "linger.ms": 5}


def test_contradicting_nested_and_top_level_settings_are_refused_by_name() -> None:
    """DRP-2: which of two contradicting values librdkafka keeps depends on its order of applying
    them; the layer refuses instead of guessing."""
    with pytest.raises(ConfigError) as caught:
        read_kafka_config({"auto.offset.reset": "earliest", "default.topic.config": {"auto.offset.reset": "latest"}})
    assert caught.value.setting == "auto.offset.reset"
    same = read_kafka_config({"acks": "all", "default.topic.config": {"acks": "ALL"}})
    assert same == {"acks": "all"}


def test_nested_topic_settings_must_be_a_dict() -> None:
    with pytest.raises(ConfigError) as caught:
        read_kafka_config({"default.topic.config": "auto.offset.reset=smallest"})
    assert caught.value.setting == "default.topic.config"


@pytest.mark.parametrize(("value", "expected"), [
    ("smallest", "earliest"), ("earliest", "earliest"), ("beginning", "earliest"), ("SMALLEST", "earliest"),
    ("largest", "latest"), ("latest", "latest"), ("end", "latest"), (" Largest ", "latest"),
])
def test_offset_reset_aliases(value: str, expected: str) -> None:
    """DRP-2: librdkafka's aliases of ``auto.offset.reset``."""
    assert offset_reset({"auto.offset.reset": value}) == expected


def test_offset_reset_default_and_refusals() -> None:
    assert offset_reset({}) == "latest"
    assert offset_reset({}, default="earliest") == "earliest"
    for value in ("error", "oldest"):
        with pytest.raises(ConfigError) as caught:
            offset_reset({"auto.offset.reset": value})
        assert caught.value.setting == "auto.offset.reset"


@pytest.mark.parametrize(("value", "expected"), [
    (True, True), (False, False), ("true", True), ("FALSE", False), ("t", True), ("f", False), ("1", True),
    ("0", False), (1, True), (0, False),
])
def test_flags_as_librdkafka_reads_them(value: Any, expected: bool) -> None:
    assert flag({"enable.auto.commit": value}, "enable.auto.commit", not expected) is expected


def test_a_flag_that_is_not_a_boolean_is_refused_by_name() -> None:
    assert flag({}, "enable.auto.commit", True) is True
    with pytest.raises(ConfigError) as caught:
        flag({"enable.auto.commit": "sometimes"}, "enable.auto.commit", True)
    assert caught.value.setting == "enable.auto.commit"


def test_integers_may_be_strings() -> None:
    assert integer({"message.max.bytes": "2000000"}, "message.max.bytes", 1) == 2_000_000
    assert integer({}, "message.max.bytes", 7) == 7
    for value in ("2 MB", True, "1.5"):
        with pytest.raises(ConfigError) as caught:
            integer({"message.max.bytes": value}, "message.max.bytes", 1)
        assert caught.value.setting == "message.max.bytes"


def test_the_layers_own_clients_take_only_how_to_reach_and_log_in() -> None:
    """DRP-2: internal clients get only what applies to them: no consumer or producer tuning, no
    callbacks of the program (its stats_cb must see its own client's statistics only)."""
    logger = logging.getLogger("program")
    program = {
        "bootstrap.servers": "b:9092", "client.id": "app", "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-256", "sasl.username": "u", "sasl.password": "p",
        "ssl.ca.location": "/ca.pem", "socket.timeout.ms": 1000, "logger": logger,
        "group.id": "g", "session.timeout.ms": 6000, "enable.auto.commit": False, "linger.ms": 5,
        "statistics.interval.ms": 1000, "stats_cb": print, "error_cb": print, "on_commit": print,
        "fetch.wait.max.ms": 10, "queued.min.messages": 5, "isolation.level": "read_committed",
        "default.topic.config": {"auto.offset.reset": "smallest", "acks": "all"},
    }
    assert connection_settings(program) == {
        "bootstrap.servers": "b:9092", "client.id": "app", "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-256", "sasl.username": "u", "sasl.password": "p",
        "ssl.ca.location": "/ca.pem", "socket.timeout.ms": 1000, "logger": logger,
    }


@pytest.mark.parametrize(("name", "value"), [
    ("enable.partition.eof", True), ("partition.assignment.strategy", "range"), ("group.protocol", "consumer"),
    ("auto.offset.reset", "error"), ("enable.auto.commit", "sometimes"),
])
def test_the_drop_in_consumer_refuses_what_it_cannot_honour(name: str, value: Any) -> None:
    """DRP-2: a setting the layer cannot honour is refused with a typed error naming it, before any
    connection is made, never silently ignored."""
    with pytest.raises(ConfigError) as caught:
        OrderedConsumer({"bootstrap.servers": "127.0.0.1:1", "group.id": "g", name: value},
                        redis_url="redis://127.0.0.1:1")
    assert caught.value.setting == name


def test_the_drop_in_consumer_takes_what_it_honours_in_any_spelling() -> None:
    """DRP-2: nested topic settings, aliases and strings are read, not refused."""
    consumer = OrderedConsumer({"bootstrap.servers": "127.0.0.1:1", "group.id": "g",
                                "default.topic.config": {"auto.offset.reset": "smallest"},
                                "enable.auto.commit": "false", "enable.partition.eof": "false",
                                "partition.assignment.strategy": "cooperative-sticky"},
                               redis_url="redis://127.0.0.1:1")
    try:
        assert consumer._start == StartPosition.TRIM_HORIZON
        assert consumer._auto_commit is False
    finally:
        consumer.close()


def test_the_drop_in_producer_reads_acks_under_both_names_and_nested() -> None:
    """DRP-1: ``acks`` hidden in ``default.topic.config`` or spelled ``request.required.acks`` is
    read before the layer enforces acks=all: a contrary value is refused, not overridden."""
    for conf in ({"default.topic.config": {"acks": 1}}, {"request.required.acks": "1"},
                 {"enable.idempotence": "false"}):
        with pytest.raises(ConfigError) as caught:
            OrderedProducer({"bootstrap.servers": "127.0.0.1:1", **conf})
        assert caught.value.setting in ("acks", "request.required.acks", "enable.idempotence")
