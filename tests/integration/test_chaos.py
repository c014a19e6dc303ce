"""Faults: kill -9 of a subscriber process, a joining and leaving subscriber, fencing (SUB-3..5, ACK-5, GRP-2)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ordering_layer import AckResponse, Admin, Message, OrderedProducer, Subscriber
from ordering_layer.state import StateStore
from ordering_layer.subscriber.engine import LEAVE_TIMEOUT
from tests.checker import wait_until
from tests.integration.conftest import publish_keys, recording_callback

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

ROOT = Path(__file__).resolve().parents[2]


class WorkerProcess:
    """A subscriber process (tests/integration/subscriber_worker.py) logging to a JSON-lines file."""

    def __init__(self, name: str, endpoints: Any, subscription: str, log: Path, *extra: str) -> None:
        self.name = name
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.subscriber_worker", "--bootstrap", endpoints.bootstrap,
             "--kafka-config", endpoints.kafka_config_file, "--redis-url", endpoints.redis_url,
             "--subscription", subscription, "--name", name, "--log", str(log), *extra],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})

    def kill(self) -> float:
        """SIGKILL; returns the wall-clock time of the kill."""
        at = time.time()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        return at

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def read_events(*logs: Path) -> list[dict[str, Any]]:
    """Every event logged by the worker processes (a torn last line of a killed process is skipped)."""
    events = []
    for log in logs:
        if log.exists():
            for line in log.read_text().splitlines():
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return events


def acked_ids(*logs: Path) -> set[str]:
    return {e["id"] for e in read_events(*logs) if e["action"] == "ack"}


def settled_ids(events: list[dict[str, Any]], killed: str) -> set[str]:
    """Acks logged, plus acks the killed process sent but did not live to log: it logged "release"
    (about to ack) and nobody delivered the message again, so the ack reached Redis."""
    acked = {e["id"] for e in events if e["action"] == "ack"}
    last_delivery = {e["id"]: e for e in events if e["action"] == "deliver"}
    for event in events:
        if event["action"] == "release" and event["sub"] == killed and event["id"] not in acked:
            later = last_delivery[event["id"]]
            if later["sub"] == killed and later["at"] <= event["at"]:
                acked.add(event["id"])
    return acked


def test_kill_9_mid_stream_second_subscriber_takes_over(tmp_path: Path, admin: Admin,
                                                         kafka_config: dict[str, Any], endpoints: Any,
                                                         subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-3, SUB-4, SUB-5, GRP-2: subscriber A is killed with SIGKILL mid-stream while B runs; B takes
    over A's partitions: nothing is lost, every key stays in order with the cascade, and no message
    whose ack A saw succeed is delivered again."""
    topic, name = subscription(partitions=4)
    checker = publish_keys(kafka_config, topic, keys=100, per_key=30)
    log_a, log_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a = WorkerProcess("A", endpoints, name, log_a, "--delay-ms", "25")
    b: WorkerProcess | None = None
    try:
        wait_until(lambda: len(acked_ids(log_a)) >= 300, 60, "A to ack 300 messages")
        b = WorkerProcess("B", endpoints, name, log_b, "--delay-ms", "3")
        wait_until(lambda: any(e["sub"] == "B" for e in read_events(log_b)), 60, "B to receive partitions")
        killed_at = a.kill()
        checker.subscriber_died("A", killed_at)
        wait_until(lambda: len(settled_ids(read_events(log_a, log_b), "A")) == checker.total()
                   and admin.describe_subscription(name).backlog == 0, 120, "every message acked")
    finally:
        a.stop()
        if b is not None:
            b.stop()
    events = read_events(log_a, log_b)
    unlogged = settled_ids(events, "A") - acked_ids(log_a, log_b)
    for event in events:
        checker.record(event["id"], event["sub"], event["attempt"], event["action"], at=event["at"])
        if event["action"] == "release" and event["id"] in unlogged:
            checker.record(event["id"], event["sub"], event["attempt"], "ack", at=event["at"])
    assert checker.verify() == []
    acked_by_a = {e["id"]: e["at"] for e in events if e["sub"] == "A" and e["action"] == "ack"}
    redelivered = [e for e in events if e["sub"] == "B" and e["action"] == "deliver" and e["id"] in acked_by_a]
    assert redelivered == []
    assert any(e["sub"] == "B" and e["attempt"] > 1 for e in events), "B redelivered A's in-flight messages"


def test_join_and_leave_rebalance_with_fencing(kafka_config: dict[str, Any], endpoints: Any,
                                               subscription: Callable[..., tuple[str, str]]) -> None:
    """GRP-2, SUB-5, ACK-5: a second subscriber joins (partitions split 2/2) and leaves again; order and
    affinity hold throughout, and an ack from a fenced former owner is refused."""
    topic, name = subscription(partitions=4)
    checker = publish_keys(kafka_config, topic, keys=60, per_key=60)
    fast = {**kafka_config, "session.timeout.ms": 6000, "heartbeat.interval.ms": 500}

    def handler(message: Message) -> str:
        time.sleep(0.01)
        return "ack"

    def acked_by(subscriber: str) -> int:
        return sum(1 for e in list(checker.events) if e.subscriber == subscriber and e.action == "ack")

    first = Subscriber(fast, redis_url=endpoints.redis_url).subscribe(
        name, recording_callback(checker, "s1", handler), max_workers=6)
    second = None
    try:
        wait_until(lambda: checker.acked_count() >= 300, 60, "first subscriber progress")
        second = Subscriber(fast, redis_url=endpoints.redis_url).subscribe(
            name, recording_callback(checker, "s2", handler), max_workers=6)
        wait_until(lambda: len(first.engine.assigned_partitions()) == 2
                   and len(second.engine.assigned_partitions()) == 2, 60, "a 2/2 split")
        wait_until(lambda: acked_by("s2") >= 100, 60, "the second subscriber's progress")
        second.cancel()
        wait_until(lambda: len(first.engine.assigned_partitions()) == 4, 60, "partitions back at the first")
        wait_until(lambda: checker.acked_count() == checker.total(), 120, "every message acked")
    finally:
        first.cancel()
        if second is not None:
            second.cancel()
    assert checker.verify() == []
    assert {e.subscriber for e in checker.deliveries()} == {"s1", "s2"}

    # Fencing: a message held by the owner; another owner claims the partition; the ack is refused.
    checker2 = publish_keys(kafka_config, topic, keys=1, per_key=2, prefix="fence")
    with Subscriber(kafka_config, redis_url=endpoints.redis_url) as zombie:
        held: list[Message] = []
        deadline = time.monotonic() + 30
        while not held and time.monotonic() < deadline:
            held = zombie.pull(name, max_messages=1, timeout=0.5)
        assert held and held[0].ordering_key == "fence-0"
        StateStore(endpoints.redis_url).claim(name, held[0].partition())
        assert held[0].ack_with_response().result(10) == AckResponse.LEASE_LOST
        assert checker2.total() == 2


def test_repeated_join_and_leave_loses_nothing(kafka_config: dict[str, Any], endpoints: Any,
                                               subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-3, SUB-1, SUB-4: a second subscriber joins and leaves three times while the first consumes
    4,000 messages, so partitions are revoked from and assigned back to the first mid-stream (records
    fetched for an ended ownership must never replace the refetch of the next one): every message is
    acked, each key in order."""
    topic, name = subscription(partitions=4)
    checker = publish_keys(kafka_config, topic, keys=50, per_key=80)
    fast = {**kafka_config, "session.timeout.ms": 6000, "heartbeat.interval.ms": 500}

    def handler(message: Message) -> str:
        time.sleep(0.02)
        return "ack"

    first = Subscriber(fast, redis_url=endpoints.redis_url).subscribe(
        name, recording_callback(checker, "s1", handler), max_workers=8)
    try:
        wait_until(lambda: len(first.engine.assigned_partitions()) == 4, 60, "the first subscriber's assignment")
        for cycle in range(3):
            if checker.acked_count() == checker.total():
                break
            second = Subscriber(fast, redis_url=endpoints.redis_url).subscribe(
                name, recording_callback(checker, f"s2-{cycle}", handler), max_workers=8)
            try:
                wait_until(second.engine.assigned_partitions, 60, "partitions at the second")
                # It takes part before it leaves (the run must revoke deliveries in progress).
                joined = f"s2-{cycle}"
                wait_until(lambda: any(e.subscriber == joined for e in checker.deliveries())  # noqa: B023
                           or checker.acked_count() == checker.total(), 60, "a delivery at the second")
            finally:
                second.cancel()
            wait_until(lambda: len(first.engine.assigned_partitions()) == 4, 60, "partitions back at the first")
        wait_until(lambda: checker.acked_count() == checker.total(), 180, "every message acked")
    finally:
        first.cancel()
    assert checker.verify() == []
    assert len({e.subscriber for e in checker.deliveries()}) > 1


@pytest.mark.parametrize("service", ["redis", "broker"])
def test_service_restart_mid_stream_loses_nothing(service: str, restartable: Any, kafka_config: dict[str, Any],
                                                  endpoints: Any,
                                                  subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-3, SUB-1: Redis killed with SIGKILL and restarted (AOF), or the broker stopped and restarted,
    mid-stream: every message is still acked, in per-key order."""
    topic, name = subscription(partitions=3)
    checker = publish_keys(kafka_config, topic, keys=40, per_key=40)
    restarted = threading.Event()

    def handler(message: Message) -> str:
        time.sleep(0.002)
        return "ack"

    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with subscriber.subscribe(name, recording_callback(checker, "s1", handler), max_workers=4):
        wait_until(lambda: checker.acked_count() >= checker.total() // 3, 60, "a third acked")
        if service == "redis":
            restartable.stop_redis(kill=True)
            restartable.start_redis()
        else:
            restartable.stop_broker()
            restartable.start_broker()
        restarted.set()
        wait_until(lambda: checker.acked_count() == checker.total(), 180, "every message acked after the restart")
    assert checker.verify() == []


def test_close_with_the_broker_down_is_bounded_and_keeps_the_acks(
        restartable: Any, kafka_config: dict[str, Any], endpoints: Any,
        subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-3 and close's bound: with the broker down, closing a subscriber waits ``LEAVE_TIMEOUT`` for
    the last commit and the group leave, not the group coordinator's 45 s; the acks it made are kept
    (Redis has them), so the next subscriber delivers none of them again."""
    topic, name = subscription(partitions=1)
    with OrderedProducer(kafka_config) as producer:
        for n in range(200):
            producer.produce(topic, f"m{n}".encode(), key="one-key")
    acked: list[bytes] = []
    done = threading.Event()

    def ack(message: Message) -> None:
        message.ack()
        acked.append(message.data)
        if len(acked) == 200:
            done.set()

    handle = Subscriber(kafka_config, redis_url=endpoints.redis_url).subscribe(name, ack, max_workers=2)
    try:
        assert done.wait(60), f"{len(acked)} of 200 acked"
        restartable.stop_broker(kill=True)
        try:
            started = time.monotonic()
            handle.cancel()
            closed_in = time.monotonic() - started
        finally:
            restartable.start_broker()
    finally:
        handle.cancel()  # nothing more to do once cancelled
    assert closed_in < LEAVE_TIMEOUT + 5, f"close took {closed_in:.1f} s with the broker down"

    with OrderedProducer(kafka_config) as producer:
        producer.produce(topic, b"after", key="one-key")
    delivered: list[bytes] = []
    after = threading.Event()

    def record(message: Message) -> None:
        delivered.append(message.data)
        message.ack()
        if message.data == b"after":
            after.set()

    with Subscriber(kafka_config, redis_url=endpoints.redis_url).subscribe(name, record):
        assert after.wait(120), f"the message published after the restart never came: {delivered[:5]}"
    # One key: any acked message delivered again would have come before the new one.
    assert delivered == [b"after"]
