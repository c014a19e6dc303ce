"""Interoperability with Kafka clients this project did not write, both directions (PUB-6, PUB-7, DRP).

kcat (librdkafka's command-line client, Debian's package), the broker's own Java console tools
(from the pinned Kafka jars), and plain confluent-kafka Producer/Consumer: records the layer
publishes read back as key = ordering key, value = payload byte for byte, headers = attributes;
records they write are delivered by the layer in key order.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from ordering_layer import Admin, Message, OrderedConsumer, OrderedProducer, Subscriber
from ordering_layer.record import HEADER_PARTITION_COUNT
from ordering_layer.stack.jars import kafka_jars, kafka_tools_jars
from tests.integration.conftest import pull_until
from tests.kafka_helpers import end_offsets, headers_of, read_topic

pytestmark = pytest.mark.integration

PAYLOAD = b"hello \x00\xff world"
KEYS = [f"key-{k}" for k in range(5)]
PER_KEY = 20


def _kcat() -> str:
    path = shutil.which("kcat")
    if path is None:
        pytest.fail("kcat is missing: `make setup` installs Debian's kcat")
    return path


def _java_tool(tool: str, *args: str, stdin: str | None = None, timeout: float = 120) -> str:
    """Run one of Kafka's command-line tools (class name under ``org.apache.kafka.tools``)."""
    classpath = f"{kafka_jars()}/*:{kafka_tools_jars()}/*"
    result = subprocess.run(["java", "-Xmx256m", "-cp", classpath, f"org.apache.kafka.tools.{tool}", *args],
                            input=stdin, capture_output=True, text=True, timeout=timeout, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def _keyed_lines() -> list[tuple[str, int]]:
    """(key, number) interleaved over the keys, numbered per key."""
    return [(key, n) for n in range(PER_KEY) for key in KEYS]


def _assert_key_order(got: list[tuple[str, int]]) -> None:
    """SUB-1: every key's numbers arrive complete and in order."""
    per_key: dict[str, list[int]] = defaultdict(list)
    for key, number in got:
        per_key[key].append(number)
    assert {key: per_key[key] for key in KEYS} == {key: list(range(PER_KEY)) for key in KEYS}


def _consume_all(kafka_config: dict[str, Any], redis_url: str, name: str, topic: str,
                 count: int) -> list[Message]:
    """The subscription's messages through OrderedConsumer (a poll loop with auto-commit)."""
    got: list[Message] = []
    consumer = OrderedConsumer({**kafka_config, "group.id": name}, redis_url=redis_url)
    consumer.subscribe([topic])
    deadline = time.monotonic() + 60
    while len(got) < count and time.monotonic() < deadline:
        got.extend(consumer.consume(100, timeout=0.5))
    consumer.close()
    assert len(got) == count
    return got


def test_kcat_writes_and_the_layer_delivers_in_key_order(
        kafka_config: dict[str, Any], endpoints: Any, subscription: Callable[..., tuple[str, str]],
        admin: Admin) -> None:
    """PUB-7, SUB-1: keyed lines produced by kcat are delivered in key order by Subscriber and
    OrderedConsumer; kcat's headers are the attributes; no layer metadata is needed."""
    topic, name = subscription(partitions=3)
    lines = "".join(f"{key}:{key}-{n}\n" for key, n in _keyed_lines())
    subprocess.run([_kcat(), "-P", "-b", kafka_config["bootstrap.servers"], "-t", topic, "-K:",
                    "-H", "origin=kcat", "-z", "none"], input=lines, text=True, check=True, timeout=60)
    got: list[Message] = []
    with Subscriber(kafka_config, redis_url=endpoints.redis_url) as subscriber:
        got = pull_until(subscriber, name, len(KEYS) * PER_KEY, ack=True)
    _assert_key_order([(m.ordering_key, int(m.data.decode().rsplit("-", 1)[1])) for m in got])
    assert all(m.attributes == {"origin": "kcat"} for m in got)
    assert all(m.message_id == str(m.sequence_number) for m in got), "no id header: the sequence number"

    second = f"{name}-consumer"
    admin.create_subscription(second, topic=topic)
    consumed = _consume_all(kafka_config, endpoints.redis_url, second, topic, len(KEYS) * PER_KEY)
    _assert_key_order([(m.key().decode(), int(m.value().decode().rsplit("-", 1)[1])) for m in consumed])


def test_kcat_reads_layer_records_as_plain_records(kafka_config: dict[str, Any],
                                                   topic_factory: Callable[..., str]) -> None:
    """PUB-6: kcat sees the payload itself, the key, and the attributes as headers."""
    topic = topic_factory(partitions=2)
    with OrderedProducer(kafka_config) as producer:
        producer.publish(topic, b"first payload", ordering_key="customer-1", attributes={"color": "blue"})
        producer.publish(topic, b"second", ordering_key="customer-1").result(timeout=30)
    out = subprocess.run([_kcat(), "-C", "-b", kafka_config["bootstrap.servers"], "-t", topic, "-e", "-q", "-J"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    records = sorted((json.loads(line) for line in out.splitlines() if line.strip()), key=lambda r: r["offset"])
    assert [(r["key"], r["payload"]) for r in records] == [("customer-1", "first payload"), ("customer-1", "second")]
    first_headers = dict(zip(records[0]["headers"][::2], records[0]["headers"][1::2], strict=True))
    assert first_headers == {HEADER_PARTITION_COUNT: "2", "color": "blue"}


def test_java_console_tools_both_directions(kafka_config: dict[str, Any], endpoints: Any,
                                            subscription: Callable[..., tuple[str, str]]) -> None:
    """PUB-6, PUB-7: the broker's own ConsoleProducer writes keyed records the layer delivers in key
    order; its ConsoleConsumer prints the layer's records as key, payload and headers."""
    bootstrap = kafka_config["bootstrap.servers"]
    topic, name = subscription(partitions=2)
    lines = "".join(f"origin:java\t{key}|{key}-{n}\n" for key, n in _keyed_lines())
    _java_tool("ConsoleProducer", "--bootstrap-server", bootstrap, "--topic", topic,
               "--property", "parse.key=true", "--property", "key.separator=|",
               "--property", "parse.headers=true", stdin=lines)
    with Subscriber(kafka_config, redis_url=endpoints.redis_url) as subscriber:
        got = pull_until(subscriber, name, len(KEYS) * PER_KEY, ack=True)
    _assert_key_order([(m.ordering_key, int(m.data.decode().rsplit("-", 1)[1])) for m in got])
    assert all(m.attributes == {"origin": "java"} for m in got)

    with OrderedProducer(kafka_config) as producer:
        producer.publish(topic, b"from the layer", ordering_key="java-key",
                         attributes={"color": "blue"}).result(timeout=30)
    printed = _java_tool("consumer.ConsoleConsumer", "--bootstrap-server", bootstrap, "--topic", topic,
                         "--from-beginning", "--max-messages", str(len(KEYS) * PER_KEY + 1),
                         "--property", "print.key=true", "--property", "print.headers=true",
                         "--property", "key.separator=|", "--timeout-ms", "60000")
    ours = [line for line in printed.splitlines() if "java-key" in line]
    assert ours == [f"{HEADER_PARTITION_COUNT}:2,color:blue|java-key|from the layer"]


def test_plain_confluent_clients_both_directions(kafka_config: dict[str, Any], endpoints: Any,
                                                 subscription: Callable[..., tuple[str, str]]) -> None:
    """PUB-6, PUB-7: a plain confluent-kafka Consumer reads the payload byte for byte and the
    attributes as headers; records of a plain Producer (headers included) are delivered in order."""
    topic, name = subscription(partitions=2)
    with OrderedProducer(kafka_config) as producer:
        producer.publish(topic, PAYLOAD, ordering_key="layer", attributes={"color": "blue"}).result(timeout=30)
    (record,) = read_topic(kafka_config, topic, 1)
    assert (record.key(), record.value()) == (b"layer", PAYLOAD)
    assert record.headers() == [(HEADER_PARTITION_COUNT, b"2"), ("color", b"blue")]

    plain = Producer(kafka_config)
    for key, n in _keyed_lines():
        plain.produce(topic, PAYLOAD + str(n).encode(), key.encode(), headers=[("n", str(n).encode())])
    assert plain.flush(30) == 0
    with Subscriber(kafka_config, redis_url=endpoints.redis_url) as subscriber:
        got = pull_until(subscriber, name, len(KEYS) * PER_KEY + 1, ack=True)
    plain_got = [m for m in got if m.ordering_key != "layer"]
    _assert_key_order([(m.ordering_key, int(m.attributes["n"])) for m in plain_got])
    assert all(m.data == PAYLOAD + m.attributes["n"].encode() for m in plain_got)
    (ours,) = [m for m in got if m.ordering_key == "layer"]
    assert (ours.data, ours.attributes) == (PAYLOAD, {"color": "blue"})


@pytest.mark.parametrize("swap", [False, True], ids=["confluent-kafka", "ordering-layer"])
def test_confluent_program_runs_with_the_import_swapped(kafka_config: dict[str, Any], endpoints: Any,
                                                        topic_factory: Callable[..., str],
                                                        unique_name: Callable[[str], str],
                                                        tmp_path: Path, swap: bool) -> None:
    """DRP-1, DRP-2: a confluent-kafka program (positional and keyword arguments, callback=, poll(0),
    len(p), flush(), on_assign, poll(timeout=1.0), msg.error(), accessors, close()) runs unchanged
    but for its import; with the layer every key arrives in order and everything is committed at close."""
    source = (Path(__file__).parent / "confluent_idiom.py").read_text()
    if swap:
        source = source.replace("from confluent_kafka import Consumer, Producer",
                                "from ordering_layer import OrderedConsumer as Consumer, OrderedProducer as Producer")
        assert "ordering_layer" in source
    program = tmp_path / "program.py"
    program.write_text(source)
    topic, group, count = topic_factory(partitions=3), unique_name("idiom"), 300
    env = {**os.environ, "ORDERING_LAYER_REDIS_URL": endpoints.redis_url}
    result = subprocess.run([sys.executable, str(program), kafka_config["bootstrap.servers"], topic, group,
                             str(count)], capture_output=True, text=True, timeout=180, env=env, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["failures"] == [] and out["left"] == 0 and out["delivered"] == count
    assert out["assigned"] == out["assignment"] == [0, 1, 2]
    seen = out["seen"]
    assert sorted(row[2] for row in seen) == list(range(count)), "every message once"
    per_key: dict[str, list[int]] = defaultdict(list)
    for key, value, number, _, _, topic_name, stamped in seen:
        assert value == f"value-{number}" and topic_name == topic and stamped
        per_key[key].append(number)
    assert all(numbers == sorted(numbers) for numbers in per_key.values()), "per-key order"
    committed = Consumer({**kafka_config, "group.id": group})
    try:
        offsets = committed.committed([TopicPartition(topic, p) for p in range(3)], timeout=30)
    finally:
        committed.close()
    assert {tp.partition: tp.offset for tp in offsets} == end_offsets(kafka_config, topic)
    assert all(headers_of(r) for r in read_topic(kafka_config, topic, count))
