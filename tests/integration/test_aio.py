"""``ordering_layer.aio``: programs in confluent_kafka.aio's idioms with the import swapped (DRP-1,
DRP-2), and the awaitable pull of asyncio servers (SUB-9 with SUB-1, SUB-3, SUB-4).

``idioms/aio_producer.py`` and ``idioms/aio_consumer.py`` are written the way confluent_kafka.aio's
example is (coroutine callbacks in the settings and for rebalances, ``await produce`` returning a
delivery future, ``poll``/``consume``/``store_offsets``/``commit``, ``unsubscribe`` then ``close``).
Each runs as it is, on confluent-kafka, and with the line importing ``AIOProducer`` or
``AIOConsumer`` swapped for ``ordering_layer.aio``'s, as ``test_idioms.py`` does for the sync pair.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from ordering_layer import Message, OrderedProducer
from ordering_layer.aio import AIOOrderedConsumer, AIOSubscriber
from tests.integration.conftest import publish_keys
from tests.integration.test_idioms import (
    COUNT,
    PER_KEY,
    _committed,
    _env,
    _lines,
    _messages,
    _printed_all,
    _program,
    _Running,
    _stats_seen,
)
from tests.kafka_helpers import read_topic

pytestmark = pytest.mark.integration

pytest.importorskip("confluent_kafka.aio", reason="confluent_kafka.aio (2.12 and later) runs the programs as written")

SWAPS = {
    "aio_producer.py": ("from confluent_kafka.aio import AIOProducer",
                        "from ordering_layer.aio import AIOOrderedProducer as AIOProducer"),
    "aio_consumer.py": ("from confluent_kafka.aio import AIOConsumer",
                        "from ordering_layer.aio import AIOOrderedConsumer as AIOConsumer"),
}


def _in_key_order(seen: list[tuple[str, str]]) -> bool:
    per_key: dict[str, list[int]] = defaultdict(list)
    for key, value in seen:
        per_key[key].append(int(value.rsplit("-", 1)[1]))
    return all(numbers == list(range(PER_KEY)) for numbers in per_key.values())


@pytest.mark.parametrize("batch", [0, 50], ids=["poll", "consume"])
def test_the_aio_example_consumer_sees_the_same_messages_with_the_import_swapped(
        kafka_config: dict[str, Any], endpoints: Any, topic_factory: Callable[..., str],
        unique_name: Callable[[str], str], tmp_path: Path, batch: int) -> None:
    """DRP-2: the consumer written in confluent_kafka.aio's idiom sees the same 300 messages with
    ``AIOOrderedConsumer`` swapped in, in key order; its coroutine stats_cb is awaited, its
    coroutine on_assign gets the consumer and calls back into it (``assignment()``) without a
    deadlock, its on_revoke runs on close, and store_offsets plus the final commit leave the group
    committed at the end offsets."""
    topic = topic_factory(partitions=3)
    producer = Producer(kafka_config)
    for key, value in _lines():
        producer.produce(topic, value, key)
    assert producer.flush(30) == 0
    seen: dict[bool, list[tuple[str, str]]] = {}
    for swap in (False, True):
        group = unique_name("aio-consumer")
        options = ["-T", "500"] + (["-B", str(batch)] if batch else [])
        running = _Running([sys.executable, str(_program("aio_consumer.py", swap, tmp_path, SWAPS)), *options,
                            kafka_config["bootstrap.servers"], group, topic], _env(endpoints.redis_url))
        running.wait_for(functools.partial(_printed_all, running), 90, "every message printed")
        running.wait_for(functools.partial(_stats_seen, running), 30, "stats_cb awaited")
        running.process.send_signal(signal.SIGINT)
        assert running.finish() == 0, running.stderr[-30:]
        assert "% Closed consumer" in running.stderr
        assert any(line.startswith("Assignment: [TopicPartition") for line in running.stdout)
        # confluent-kafka assigns after on_assign returns, the layer before it calls on_assign
        assert any(line.startswith("Owned: [") for line in running.stdout), "on_assign's call returned"
        assert not [line for line in running.stderr if "CONFWARN" in line]
        seen[swap] = _messages(running)
        _committed(kafka_config, topic, group, 3)
    assert sorted(seen[False]) == sorted(seen[True]) == sorted(_lines()), "the same messages, once each"
    assert _in_key_order(seen[True]), "per-key order, swapped"


def test_the_aio_example_producer_writes_the_same_records_with_the_import_swapped(
        kafka_config: dict[str, Any], endpoints: Any, topic_factory: Callable[..., str], tmp_path: Path) -> None:
    """DRP-1: the producer written in confluent_kafka.aio's idiom (concurrent produce tasks per
    round, the delivery futures gathered, coroutine callbacks) writes the same records with
    ``AIOOrderedProducer`` swapped in: every delivery future resolves to the record, each key's
    values in produce order in one partition (PUB-1; which one differs, murmur2 against CRC32)."""
    stdin = "".join(f"{key}\t{value}\n" for key, value in _lines())
    written: dict[bool, dict[str, list[str]]] = {}
    for swap in (False, True):
        topic = topic_factory(partitions=3, prefix="aio-producer")
        result = subprocess.run([sys.executable, str(_program("aio_producer.py", swap, tmp_path, SWAPS)),
                                 kafka_config["bootstrap.servers"], topic], input=stdin, capture_output=True,
                                text=True, timeout=90, env=_env(endpoints.redis_url), check=False)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.strip().splitlines()[-1] == f"delivered {COUNT}, failed 0", result.stdout
        assert result.stderr.count("% Message delivered to ") == COUNT
        assert "CONFWARN" not in result.stderr
        per_key: dict[str, list[str]] = defaultdict(list)
        homes: dict[str, set[int]] = defaultdict(set)
        for record in sorted(read_topic(kafka_config, topic, COUNT), key=lambda r: (r.partition(), r.offset())):
            per_key[record.key().decode()].append(record.value().decode())
            homes[record.key().decode()].add(record.partition())
        assert all(len(partitions) == 1 for partitions in homes.values()), "one partition per key"
        written[swap] = dict(per_key)
    assert written[False] == written[True]
    assert all(values == [f"value-{key.split('-')[1]}-{n}" for n in range(PER_KEY)]
               for key, values in written[True].items())


class _LoopLag:
    """The longest the event loop was late for a 10 ms tick: how long anything blocked it."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(0.01)
            self.worst = max(self.worst, time.monotonic() - before - 0.01)

    def __enter__(self) -> _LoopLag:
        self._task = asyncio.get_running_loop().create_task(self._tick())
        return self

    def __exit__(self, *exc_info: object) -> None:
        assert self._task is not None
        self._task.cancel()


KEYS, MESSAGES_PER_KEY, PULLERS = 40, 75, 4


def test_awaited_pulls_keep_per_key_order_with_acks_and_nacks_from_coroutines(
        kafka_config: dict[str, Any], endpoints: Any, subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-9 (pull awaited on an event loop), SUB-1, SUB-3, SUB-4: four coroutines pull 3,000
    messages of 40 keys concurrently through one ``AIOSubscriber``, ack them from the coroutine and
    nack about 2 % (with the rest of that key's batch); every message is acked in the end, each key's
    deliveries move forward in order with every nack's cascade complete, and the event loop is never
    blocked (a 10 ms tick is never more than 0.2 s late while pulls wait up to 0.5 s)."""
    topic, name = subscription(partitions=3)
    checker = publish_keys(kafka_config, topic, keys=KEYS, per_key=MESSAGES_PER_KEY)
    chance = random.Random(34)
    nacks = 0

    async def puller(subscriber: AIOSubscriber, label: str, deadline: float) -> None:
        nonlocal nacks
        while checker.acked_count() < checker.total() and time.monotonic() < deadline:
            batch = await subscriber.pull(name, max_messages=100, timeout=0.5)
            given_back: set[str] = set()
            for message in batch:
                checker.record(message.message_id, label, message.delivery_attempt, "deliver")
            for message in batch:
                if message.ordering_key in given_back or chance.random() < 0.02:
                    given_back.add(message.ordering_key)
                    checker.record(message.message_id, label, message.delivery_attempt, "nack")
                    message.nack()
                    nacks += 1
                else:
                    checker.record(message.message_id, label, message.delivery_attempt, "release")
                    message.ack()
                    checker.record(message.message_id, label, message.delivery_attempt, "ack")
                await asyncio.sleep(0)  # other pullers run between messages

    async def main() -> float:
        async with AIOSubscriber(kafka_config, redis_url=endpoints.redis_url) as subscriber:
            with _LoopLag() as lag:
                deadline = time.monotonic() + 45
                await asyncio.gather(*(puller(subscriber, "s1", deadline) for _ in range(PULLERS)))
            return lag.worst

    worst_lag = asyncio.run(main())
    assert checker.acked_count() == checker.total() == KEYS * MESSAGES_PER_KEY
    assert nacks > 0
    assert checker.verify(one_outstanding=False) == []
    assert worst_lag < 0.2, f"the event loop was blocked for {worst_lag:.3f} s"


class _Watched(ThreadPoolExecutor):
    """An executor that counts the calls its threads have started."""

    def __init__(self) -> None:
        super().__init__(8, thread_name_prefix="test-aio")
        self.started = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        def run() -> Any:
            with self._lock:
                self.started += 1
            return fn(*args, **kwargs)

        return super().submit(run)


async def _until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        await asyncio.sleep(0.02)


async def _cancel_while_running(executor: _Watched, call: Awaitable[Any]) -> None:
    """Start ``call``, wait until its thread runs it, then cancel the coroutine awaiting it."""
    started = executor.started
    waiting = asyncio.ensure_future(call)
    await _until(lambda: executor.started > started, 10, "the call running in its thread")
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting


def test_a_cancelled_pull_gives_back_what_it_received(
        kafka_config: dict[str, Any], endpoints: Any, subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-3: a pull whose coroutine is cancelled while its thread waits does not keep what that
    thread then receives: the message is nacked (delivery attempt 2) and the next pull gets it at
    once, not after its lease runs out."""
    topic, name = subscription(partitions=1)
    executor = _Watched()

    async def main() -> list[Message]:
        async with AIOSubscriber(kafka_config, redis_url=endpoints.redis_url, executor=executor) as subscriber:
            assert await subscriber.pull(name, timeout=1.0) == []  # joined, the partition owned
            await _cancel_while_running(executor, subscriber.pull(name, timeout=10.0))
            with OrderedProducer(kafka_config) as producer:
                producer.publish(topic, b"late", ordering_key="k").result(30)
            got: list[Message] = []
            deadline = time.monotonic() + 20
            while not got and time.monotonic() < deadline:
                got = await subscriber.pull(name, timeout=1.0)
            for message in got:
                message.ack()
            return got

    try:
        got = asyncio.run(main())
    finally:
        executor.shutdown()
    assert [(m.data, m.delivery_attempt) for m in got] == [(b"late", 2)]


def test_a_cancelled_poll_is_not_auto_committed_unseen(
        kafka_config: dict[str, Any], endpoints: Any, subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-3, DRP-2: with auto commit on, the next ``poll`` acks what the poll before it returned; a
    ``poll`` whose coroutine was cancelled returns nothing to anyone, so ``AIOOrderedConsumer``
    gives back what its thread received (nacked before the next poll runs), and the message is
    polled again (delivery attempt 2) instead of being acked unseen."""
    topic, name = subscription(partitions=1)
    executor = _Watched()

    async def main() -> list[tuple[bytes, int]]:
        async with AIOOrderedConsumer({**kafka_config, "group.id": name}, executor=executor,
                                      redis_url=endpoints.redis_url) as consumer:
            await consumer.subscribe([topic])
            assert await consumer.poll(1.0) is None
            await _cancel_while_running(executor, consumer.poll(10.0))
            with OrderedProducer(kafka_config) as producer:
                producer.publish(topic, b"late", ordering_key="k").result(30)
            seen: list[tuple[bytes, int]] = []
            deadline = time.monotonic() + 20
            while not seen and time.monotonic() < deadline:
                message = await consumer.poll(1.0)
                if message is not None:
                    seen.append((message.value(), message.delivery_attempt))
            return seen

    try:
        seen = asyncio.run(main())
    finally:
        executor.shutdown()
    assert seen == [(b"late", 2)]
