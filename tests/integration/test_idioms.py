"""Programs in confluent-kafka-python's example idioms, run as written and with the import swapped (DRP-1, DRP-2).

``idioms/producer.py`` and ``idioms/consumer.py`` are written here the way that library's own example
programs are written (old-style ``default.topic.config``, ``logger=``, ``stats_cb`` with
``statistics.interval.ms``, ``on_assign`` printing partitions, str values, ``BufferError``
handling, ``len(p)``, Ctrl-C then ``close()``). Each runs twice: as it is, on confluent-kafka, and
with the line importing ``Producer`` or ``Consumer`` swapped for ``ordering_layer``'s wrapper. Both
runs must see the same messages, commit the group at the end, and print no librdkafka CONFWARN.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from ordering_layer import OrderedConsumer
from tests.kafka_helpers import read_topic

pytestmark = pytest.mark.integration

IDIOMS = Path(__file__).parent / "idioms"
KEYS, PER_KEY = 10, 30
COUNT = KEYS * PER_KEY
SWAPS = {
    "producer.py": ("from confluent_kafka import Producer",
                    "from ordering_layer import OrderedProducer as Producer"),
    "consumer.py": ("from confluent_kafka import Consumer, KafkaException",
                    "from confluent_kafka import KafkaException\n"
                    "from ordering_layer import OrderedConsumer as Consumer"),
}


def _program(name: str, swap: bool, tmp_path: Path, swaps: dict[str, tuple[str, str]] = SWAPS) -> Path:
    """The program ``name`` of ``idioms/`` as written, or with its import swapped (``swaps``)."""
    source = (IDIOMS / name).read_text()
    if swap:
        original, swapped = swaps[name]
        assert source.count(original) == 1
        source = source.replace(original, swapped)
    path = tmp_path / f"{'swapped' if swap else 'as-written'}-{name}"
    path.write_text(source)
    return path


def _lines() -> list[tuple[str, str]]:
    return [(f"key-{k}", f"value-{k}-{n}") for n in range(PER_KEY) for k in range(KEYS)]


def _env(redis_url: str) -> dict[str, str]:
    return {**os.environ, "ORDERING_LAYER_REDIS_URL": redis_url}


class _Running:
    """A program's output, read line by line on two threads while it runs."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                         for stream, lines in ((self.process.stdout, self.stdout), (self.process.stderr, self.stderr))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream: Any, lines: list[str]) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))

    def wait_for(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise AssertionError(f"{what}: not within {timeout} s (exit {self.process.poll()}); "
                                     f"stderr: {self.stderr[-30:]}")
            time.sleep(0.05)

    def finish(self, timeout: float = 60) -> int:
        code = self.process.wait(timeout)
        for reader in self._readers:
            reader.join(10)
        return code


def _messages(running: _Running) -> list[tuple[str, str]]:
    """The (key, value) lines the consumer program printed."""
    return [(line.split(" ")[0], line.split(" ")[1]) for line in list(running.stdout) if line.startswith("key-")]


def _printed_all(running: _Running) -> bool:
    return len(_messages(running)) >= COUNT


def _stats_seen(running: _Running) -> bool:
    return any(line.startswith("KAFKA Stats: consumer") for line in list(running.stderr))


def _committed(kafka_config: dict[str, Any], topic: str, group: str, partitions: int) -> dict[int, int]:
    consumer = Consumer({**kafka_config, "group.id": group})
    try:
        offsets = consumer.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=30)
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in range(partitions)}
    finally:
        consumer.close()
    assert {tp.partition: tp.offset for tp in offsets} == ends, "the group is committed at the end offsets"
    return ends


@pytest.mark.parametrize("store", [False, True], ids=["auto-store", "store_offsets"])
def test_the_example_consumer_sees_the_same_messages_with_the_import_swapped(
        kafka_config: dict[str, Any], endpoints: Any, topic_factory: Callable[..., str],
        unique_name: Callable[[str], str], tmp_path: Path, store: bool) -> None:
    """DRP-2: the example consumer's settings are read as librdkafka reads them: 'smallest' in
    ``default.topic.config`` starts a new subscription at the oldest message (0 of 300 were seen
    when the nested dict was ignored). Swapped, it sees the same 300 messages, in key order, its
    stats_cb and on_assign are called, Ctrl-C and close() commit the group at the end offsets, and no
    internal client is handed a setting it would warn about."""
    topic = topic_factory(partitions=3)
    producer = Producer(kafka_config)
    for key, value in _lines():
        producer.produce(topic, value, key)
    assert producer.flush(30) == 0
    seen: dict[bool, list[tuple[str, str]]] = {}
    for swap in (False, True):
        group = unique_name("example-consumer")
        options = ["-T", "500"] + (["-S"] if store else [])
        running = _Running([sys.executable, str(_program("consumer.py", swap, tmp_path)), *options,
                            kafka_config["bootstrap.servers"], group, topic], _env(endpoints.redis_url))
        running.wait_for(functools.partial(_printed_all, running), 120, "every message printed")
        running.wait_for(functools.partial(_stats_seen, running), 30, "stats_cb called")
        running.process.send_signal(signal.SIGINT)
        assert running.finish() == 0, running.stderr[-30:]
        assert any(line.endswith("Aborted by user") for line in running.stderr)
        assert any(line.startswith("Assignment: [TopicPartition") for line in running.stdout)
        assert not [line for line in running.stderr if "CONFWARN" in line]
        seen[swap] = _messages(running)
        _committed(kafka_config, topic, group, 3)
    assert sorted(seen[False]) == sorted(seen[True]) == sorted(_lines()), "the same messages, once each"
    per_key: dict[str, list[int]] = defaultdict(list)
    for key, value in seen[True]:
        per_key[key].append(int(value.rsplit("-", 1)[1]))
    assert all(numbers == list(range(PER_KEY)) for numbers in per_key.values()), "per-key order, swapped"


def test_the_example_producer_writes_the_same_records_with_the_import_swapped(
        kafka_config: dict[str, Any], endpoints: Any, topic_factory: Callable[..., str], tmp_path: Path) -> None:
    """DRP-1: the example producer (str keys and values, ``default.topic.config``, ``callback=``, a
    local queue that fills, ``BufferError`` handled by polling and trying again, ``len(p)`` before
    ``flush``) writes the same records swapped: each key's values in order, in one partition (which
    one differs: librdkafka's default partitioner hashes with CRC32, the layer with Java's murmur2,
    PUB-6). confluent-kafka raises BufferError when its queue is full; the layer waits for room, as
    Java's ``send`` does, so the program's retry is not needed but does no harm."""
    stdin = "".join(f"{key}\t{value}\n" for key, value in _lines())
    written: dict[bool, dict[str, list[str]]] = {}
    for swap in (False, True):
        topic = topic_factory(partitions=3, prefix="example-producer")
        result = subprocess.run([sys.executable, str(_program("producer.py", swap, tmp_path)),
                                 kafka_config["bootstrap.servers"], topic], input=stdin, capture_output=True,
                                text=True, timeout=120, env=_env(endpoints.redis_url), check=False)
        assert result.returncode == 0, result.stderr[-3000:]
        summary = result.stdout.strip().splitlines()[-1]
        assert summary.startswith(f"delivered {COUNT}, left 0, queue full "), summary
        assert (int(summary.rsplit(" ", 2)[-2]) > 0) is not swap
        assert "% Waiting for" in result.stderr and "CONFWARN" not in result.stderr
        per_key: dict[str, list[str]] = defaultdict(list)
        homes: dict[str, set[int]] = defaultdict(set)
        for record in sorted(read_topic(kafka_config, topic, COUNT), key=lambda r: (r.partition(), r.offset())):
            per_key[record.key().decode()].append(record.value().decode())
            homes[record.key().decode()].add(record.partition())
        assert all(len(partitions) == 1 for partitions in homes.values()), "one partition per key"
        written[swap] = dict(per_key)
    assert written[False] == written[True]
    assert sum(len(values) for values in written[True].values()) == COUNT


def test_the_programs_on_commit_is_told(kafka_config: dict[str, Any], endpoints: Any,
                                        topic_factory: Callable[..., str], unique_name: Callable[[str], str]) -> None:
    """DRP-2: an ``on_commit`` in the settings is called as confluent-kafka calls it, with the
    committed partitions, alongside the layer's own commit bookkeeping."""
    topic = topic_factory(partitions=2)
    producer = Producer(kafka_config)
    for n in range(20):
        producer.produce(topic, f"v{n}", f"k{n % 4}")
    assert producer.flush(30) == 0
    told: list[tuple[Any, list[TopicPartition]]] = []
    consumer = OrderedConsumer({**kafka_config, "group.id": unique_name("on-commit"), "auto.offset.reset": "earliest",
                                "on_commit": lambda err, partitions: told.append((err, partitions))},
                               redis_url=endpoints.redis_url)
    consumer.subscribe([topic])
    got = 0
    deadline = time.monotonic() + 60
    while got < 20 and time.monotonic() < deadline:
        got += len(consumer.consume(20, timeout=1.0))
    consumer.close()
    assert got == 20
    committed: dict[int, int] = defaultdict(int)
    for err, partitions in told:
        assert err is None
        for tp in partitions:
            committed[tp.partition] = max(committed[tp.partition], tp.offset)
    ends = {p: _end(kafka_config, topic, p) for p in (0, 1)}
    assert {p: committed[p] for p, end in ends.items() if end} == {p: end for p, end in ends.items() if end}


def _end(kafka_config: dict[str, Any], topic: str, partition: int) -> int:
    consumer = Consumer({**kafka_config, "group.id": "ends"})
    try:
        return int(consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=30)[1])
    finally:
        consumer.close()
