"""SUB-4 across a crash in a recovery walk that the fetch could not finish: the walk released at the
buffer limit (``flow.MAX_BUFFERED`` records held), so the cascade of a key reached a record settled before the
crash only after the owner's death; its successor must still deliver that record again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from ordering_layer import Message, Subscriber
from ordering_layer.state import StateStore
from ordering_layer.state.store import OpKind
from ordering_layer.subscriber.flow import MAX_BUFFERED
from tests.checker import wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SPAN = MAX_BUFFERED + 5_000  # records between the cascade's start and its settled record: over the buffer bound
KEY = "k"


def _acked(log: Path, key: str) -> bool:
    if not log.exists():
        return False
    return any(json.loads(line)["key"] == key and json.loads(line)["action"] == "ack"
               for line in log.read_text().splitlines() if line)


def test_a_cascade_cut_short_by_a_crash_after_a_walk_ended_early_is_finished_by_the_successor(
        kafka_config: dict[str, Any], endpoints: Any, subscription: Callable[..., tuple[str, str]],
        tmp_path: Path) -> None:
    """SUB-4: key k's offset 0 is unsettled and its offset SPAN was settled by an earlier owner (which
    delivered it before 0 could be delivered again). A new owner walks from 0; the fetch is held at
    the buffer bound (``MAX_BUFFERED`` records of 1 byte), long before SPAN, so it releases: it
    delivers 0 and acks it (the other keys' handlers hold their messages) and is killed with SIGKILL.
    Its successor finds 0 and SPAN settled, and must deliver both again, in order: 0 went out again
    after SPAN had, so SPAN must too."""
    topic, name = subscription(partitions=1)
    producer = Producer({**kafka_config, "linger.ms": 20})
    producer.produce(topic, key=KEY.encode(), value=b"first", partition=0)
    for i in range(1, SPAN):
        producer.produce(topic, key=f"other-{i % 100}".encode(), value=b"x", partition=0)
        if i % 10_000 == 0:
            producer.flush(30)
    producer.produce(topic, key=KEY.encode(), value=b"last", partition=0)
    assert producer.flush(30) == 0
    store = StateStore(endpoints.redis_url)
    earlier = store.claim(name, 0).epoch  # an earlier owner acked the key's last record, then died
    store.apply_many([(name, 0, earlier, [(OpKind.SETTLED, SPAN, 0)])])

    log = tmp_path / "deliveries.jsonl"
    worker = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.subscriber_worker", "--bootstrap", endpoints.bootstrap,
         "--kafka-config", endpoints.kafka_config_file, "--redis-url", endpoints.redis_url,
         "--subscription", name, "--name", "a", "--log", str(log), "--hold-unless-key", KEY],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        wait_until(lambda: _acked(log, KEY), 90, "the walk ended at the buffer limit and offset 0 was acked")
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait(30)

    delivered: list[int] = []

    def callback(message: Message) -> None:
        if message.ordering_key == KEY:
            delivered.append(message.offset())
        message.ack()

    with Subscriber(kafka_config, redis_url=endpoints.redis_url) as successor:
        handle = successor.subscribe(name, callback)
        try:
            wait_until(lambda: len(delivered) >= 2, 90, "the successor delivered both messages of the key")
        finally:
            handle.cancel()
    assert delivered[:2] == [0, SPAN]
