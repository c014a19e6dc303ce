"""Scheduled messages (PUB-5): invisible before enqueue_at, published after with the schedule id as
message id; cancel before and after activation; no loss across a kill -9 of the scheduler and a
Redis flush; several schedulers share the work."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis

from ordering_layer import CancelResult, OrderedProducer, Scheduler, Subscriber
from ordering_layer.publisher.activation import join_activation
from ordering_layer.pytest_plugin import CreatedSubscription
from ordering_layer.record import HEADER_MESSAGE_ID, now_ms
from ordering_layer.scheduler.index import ScheduleIndex
from ordering_layer.scheduler.records import ScheduledMessage, ScheduleState
from ordering_layer.scheduler.settings import SchedulerSettings
from ordering_layer.stack import Endpoints
from tests.checker import wait_until
from tests.integration.conftest import cli_servers, pull_until
from tests.kafka_helpers import headers_of, read_topic

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _producer(endpoints: Endpoints, schedule_topic: str, scheduler: bool = True) -> OrderedProducer:
    return OrderedProducer(endpoints.kafka_config(), redis_url=endpoints.redis_url,
                           settings={"scheduler": scheduler, "schedule_topic": schedule_topic})


def _activated_ids(endpoints: Endpoints, topic: str, expected: int, timeout: float = 60.0) -> list[tuple[str, int]]:
    """(message id, broker timestamp ms) of every record of ``topic``, once ``expected`` arrived."""
    records = read_topic(endpoints.kafka_config(), topic, expected, timeout)
    return [(headers_of(r)[HEADER_MESSAGE_ID].decode(), r.timestamp()[1]) for r in records]


class SchedulerProcess:
    """A dedicated ``ordering-layer scheduler`` process."""

    def __init__(self, endpoints: Endpoints, schedule_topic: str, lease: float, log: Path) -> None:
        self.log = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from ordering_layer.cli import main; main()", "scheduler",
             *cli_servers(endpoints),
             "--schedule-topic", schedule_topic, "--lease", str(lease), "--batch", "10"],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()


def test_scheduled_message_is_invisible_before_enqueue_at_and_delivered_after(
        endpoints: Endpoints, subscription_factory: Callable[..., CreatedSubscription],
        unique_name: Callable[[str], str]) -> None:
    """PUB-5: a message scheduled 3 s ahead is not delivered before enqueue_at and is delivered
    after, as a new message with the same ordering key and the schedule id as message id."""
    created = subscription_factory(partitions=2)
    enqueue_at = datetime.now(UTC) + timedelta(seconds=3)
    with _producer(endpoints, unique_name("sched")) as producer, \
            Subscriber(endpoints.kafka_config(), redis_url=endpoints.redis_url) as subscriber:
        first = producer.publish(created.topic, b"before", ordering_key="k").result(30)
        schedule_id = producer.schedule(created.topic, b"later", ordering_key="k", attributes={"a": "1"},
                                        enqueue_at=enqueue_at)
        early = pull_until(subscriber, created.subscription, 1, ack=True)
        assert [m.data for m in early] == [b"before"]
        while datetime.now(UTC) < enqueue_at - timedelta(milliseconds=300):
            assert subscriber.pull(created.subscription, max_messages=10, timeout=0.2) == []
        [message] = pull_until(subscriber, created.subscription, 1, timeout=30, ack=True)
    assert message.data == b"later"
    assert message.message_id == schedule_id
    assert message.ordering_key == "k"
    assert message.attributes == {"a": "1"}
    assert message.enqueued_time >= enqueue_at - timedelta(milliseconds=1)
    assert message.sequence_number > first.sequence_number


def test_cancel_before_and_after_activation(endpoints: Endpoints, topic_factory: Callable[..., str],
                                            unique_name: Callable[[str], str]) -> None:
    """PUB-5: cancel before activation removes the message; after activation it reports that the
    message was already enqueued; an unknown id is not found."""
    topic = topic_factory()
    enqueue_at = datetime.now(UTC) + timedelta(seconds=2)
    with _producer(endpoints, unique_name("sched")) as producer:
        cancelled = producer.schedule(topic, b"cancelled", ordering_key="k", enqueue_at=enqueue_at)
        kept = producer.schedule(topic, b"kept", ordering_key="k", enqueue_at=enqueue_at)
        assert producer.cancel_scheduled(cancelled) is CancelResult.CANCELLED
        assert producer.cancel_scheduled(cancelled) is CancelResult.CANCELLED
        [(message_id, _)] = _activated_ids(endpoints, topic, 1)
        assert message_id == kept
        assert producer.cancel_scheduled(kept) is CancelResult.ALREADY_ENQUEUED
        assert producer.cancel_scheduled("no-such-id") is CancelResult.NOT_FOUND
        later = producer.schedule(topic, b"last", enqueue_at=datetime.now(UTC))
        ids = [i for i, _ in _activated_ids(endpoints, topic, 2)]
    assert ids == [kept, later]


def test_kill_9_of_the_scheduler_and_a_redis_flush_lose_nothing(
        endpoints: Endpoints, restartable: Any, topic_factory: Callable[..., str],
        unique_name: Callable[[str], str], tmp_path: Path) -> None:
    """PUB-5: kill -9 of a dedicated scheduler mid-way and a Redis FLUSHALL: every scheduled message
    is published, none before its enqueue_at, and a duplicate only ever carries the same id."""
    topic = topic_factory(partitions=3)
    schedule_topic = unique_name("sched")
    start = datetime.now(UTC) + timedelta(seconds=1)
    count = 200
    with _producer(endpoints, schedule_topic, scheduler=False) as producer:
        due = {producer.schedule(topic, f"m{n}".encode(), ordering_key=f"k{n % 7}",
                                 enqueue_at=start + timedelta(milliseconds=20 * n)): start + timedelta(
                                     milliseconds=20 * n) for n in range(count)}
    log = tmp_path / "scheduler.log"
    first = SchedulerProcess(endpoints, schedule_topic, lease=2.0, log=log)
    try:
        before_kill = _activated_ids(endpoints, topic, 20, timeout=60)
        first.kill()
        assert 20 <= len(before_kill) < count, log.read_text()
    finally:
        first.stop()
    redis.Redis.from_url(endpoints.redis_url).flushall()
    second = SchedulerProcess(endpoints, schedule_topic, lease=2.0, log=log)
    try:
        deadline = time.monotonic() + 90
        while True:
            activated = _activated_ids(endpoints, topic, count, timeout=5)
            if {i for i, _ in activated} >= set(due) or time.monotonic() > deadline:
                break
    finally:
        second.stop()
    ids = Counter(i for i, _ in activated)
    missing = set(due) - set(ids)
    assert not missing, f"{len(missing)} scheduled messages lost; scheduler log:\n{log.read_text()[-2000:]}"
    assert set(ids) <= set(due)
    for message_id, stamp in activated:
        assert stamp >= int(due[message_id].timestamp() * 1000), message_id


def test_two_schedulers_activate_each_message_once(endpoints: Endpoints, topic_factory: Callable[..., str],
                                                   unique_name: Callable[[str], str]) -> None:
    """PUB-5: two schedulers of one schedule topic share the work; each message is activated once."""
    topic = topic_factory(partitions=2)
    schedule_topic = unique_name("sched")
    kafka = endpoints.kafka_config()
    settings = {"schedule_topic": schedule_topic, "batch": 5, "poll_interval": 0.05}
    one = Scheduler(kafka, endpoints.redis_url, settings=settings, name="scheduler-one")
    two = Scheduler(kafka, endpoints.redis_url, settings=settings, name="scheduler-two")
    count = 300
    with _producer(endpoints, schedule_topic, scheduler=False) as producer:
        start = datetime.now(UTC) + timedelta(seconds=1)
        scheduled = [producer.schedule(topic, b"x", ordering_key=f"k{n % 5}",
                                       enqueue_at=start + timedelta(milliseconds=5 * n)) for n in range(count)]
    one.start()
    two.start()
    try:
        wait_until(lambda: one.activated + two.activated >= count, 60, "every message activated")
    finally:
        one.stop()
        two.stop()
    ids = Counter(i for i, _ in _activated_ids(endpoints, topic, count))
    assert set(ids) == set(scheduled)
    assert max(ids.values()) == 1
    assert one.activated > 0 and two.activated > 0
    assert one.activated + two.activated == count


def test_index_claims_with_a_lease_and_cancels_only_unclaimed(endpoints: Endpoints,
                                                              unique_name: Callable[[str], str]) -> None:
    """PUB-5: a claimed message cannot be cancelled; a claim whose lease ended is claimed again
    (a crashed scheduler's work comes back); completion is counted once."""
    index = ScheduleIndex(endpoints.redis_url, unique_name("sched"))
    index.mark_built()
    now = now_ms()
    messages = [ScheduledMessage(f"id{n}", "t", b"d", now - 10 + n, now) for n in range(3)]
    for message in messages:
        assert index.add(message)
    later = ScheduledMessage("later", "t", b"d", now + 60_000, now)
    index.add(later)
    claim = index.claim(now, 1000, 2)
    assert [m.schedule_id for m in claim.messages] == ["id0", "id1"]
    assert index.cancel("id0", now).result is CancelResult.ALREADY_ENQUEUED
    assert index.cancel("id2", now).result is CancelResult.CANCELLED
    assert claim.next_ms == now - 8  # id2, still due
    waiting = index.claim(now + 500, 1000, 10)
    assert waiting.messages == []
    assert waiting.next_ms == now + 1000  # the lease of id0 and id1 ends
    again = index.claim(now + 1001, 1000, 10)
    assert [m.schedule_id for m in again.messages] == ["id0", "id1"]
    assert index.complete(["id0", "id1"], ScheduleState.ACTIVATED, now) == ["id0", "id1"]
    assert index.complete(["id0"], ScheduleState.ACTIVATED, now) == []
    assert [m.schedule_id for m, _ in index.pending()] == ["later"]
    assert sorted(index.sweep(now + 1, 10)) == ["id0", "id1", "id2"]
    assert index.cancel("id0", now).result is CancelResult.NOT_FOUND


def test_a_subscriber_side_participant_activates_with_its_own_producer(
        endpoints: Endpoints, topic_factory: Callable[..., str], unique_name: Callable[[str], str]) -> None:
    """PUB-5: ``join_activation`` (how Subscriber/OrderedConsumer take part) activates due messages
    from a consumer's config, through a producer it makes itself; it stops at close()."""
    topic = topic_factory()
    schedule_topic = unique_name("sched")
    consumer_config = {**endpoints.kafka_config(), "group.id": "g", "enable.auto.commit": False,
                       "auto.offset.reset": "earliest"}
    with _producer(endpoints, schedule_topic, scheduler=False) as producer:
        schedule_id = producer.schedule(topic, b"due", ordering_key="k", enqueue_at=datetime.now(UTC))
    activation = join_activation(consumer_config, endpoints.redis_url,
                                 settings=SchedulerSettings(schedule_topic=schedule_topic))
    try:
        assert [i for i, _ in _activated_ids(endpoints, topic, 1)] == [schedule_id]
    finally:
        activation.close()
    switched_off = join_activation(consumer_config, endpoints.redis_url, enabled=False)
    assert not hasattr(switched_off, "scheduler")
    switched_off.close()


def test_a_running_subscription_activates_without_anything_else(
        endpoints: Endpoints, subscription_factory: Callable[..., CreatedSubscription]) -> None:
    """PUB-5: as in Service Bus, no extra process is needed: with the producer not taking part, a
    running ``Subscriber.subscribe`` activates the due message (default schedule topic) and gets it."""
    created = subscription_factory(partitions=1)
    kafka = endpoints.kafka_config()
    with OrderedProducer(kafka, redis_url=endpoints.redis_url, settings={"scheduler": False}) as producer:
        schedule_id = producer.schedule(created.topic, b"due soon", ordering_key="k",
                                        enqueue_at=datetime.now(UTC) + timedelta(seconds=1))
    got: list[str] = []

    def callback(message: Any) -> None:
        got.append(message.message_id)
        message.ack()

    with Subscriber(kafka, redis_url=endpoints.redis_url).subscribe(created.subscription, callback):
        wait_until(lambda: got == [schedule_id], 30, "the scheduled message, activated by the subscriber")
