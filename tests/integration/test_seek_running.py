"""Seeks applied by running subscribers (GRP-3): without a restart, fenced against stale acks, with
cascade and delivery attempts restarting at 1; a seek pending when a partition is claimed."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from confluent_kafka import Consumer

from ordering_layer import AckResponse, Admin, Message, RetryPolicy, Subscriber
from ordering_layer.errors import SeekTimeoutError
from ordering_layer.pytest_plugin import CreatedSubscription
from ordering_layer.stack import Endpoints
from ordering_layer.state import StateStore
from ordering_layer.state.store import partition_keys
from tests.checker import wait_until
from tests.integration.conftest import pull_until
from tests.integration.test_seek import by_key, publish, replay

pytestmark = pytest.mark.integration

NO_BACKOFF = RetryPolicy(minimum_backoff=0, maximum_backoff=0)


class Recorder:
    """A callback that acks, except: the first delivery of ``hold`` is kept (never acked by it), and
    redeliveries of ``block_key`` wait for ``release``."""

    def __init__(self, hold: str, block_key: str) -> None:
        self.hold, self.block_key = hold, block_key
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.deliveries: list[tuple[str, str, int, int]] = []  # key, data, attempt, delivery number
        self.count: Counter[str] = Counter()
        self.held: list[Message] = []
        self.acked: Counter[str] = Counter()

    def __call__(self, message: Message) -> None:
        data = message.data.decode()
        with self.lock:
            self.count[data] += 1
            number = self.count[data]
            self.deliveries.append((message.ordering_key, data, message.delivery_attempt, number))
            if data == self.hold and number == 1:
                self.held.append(message)
                return
        if message.ordering_key == self.block_key and number > 1:
            self.release.wait(60)
        message.ack_with_response().result(30)
        with self.lock:
            self.acked[data] += 1

    def replays(self) -> list[tuple[str, str, int, int]]:
        with self.lock:
            return [d for d in self.deliveries if d[3] > 1]


def test_seek_during_a_running_subscription_with_three_subscribers(
        admin: Admin, kafka_config: dict[str, Any], endpoints: Endpoints,
        subscription_factory: Callable[..., CreatedSubscription]) -> None:
    """GRP-3, ACK-5, ACK-6, SUB-4: three running subscribers apply a seek back to before every message
    within seconds, without a restart: each key is delivered again from its first message, in order,
    with delivery attempt 1; a delivery made before the seek and acked after it is refused (LEASE_LOST)
    and does not settle its message; the replay of that message is acked normally."""
    created = subscription_factory(partitions=3, retry_policy=NO_BACKOFF, ack_deadline=60)
    before = datetime.now(UTC) - timedelta(seconds=1)
    items = [(f"k{k}", f"k{k}-{n}") for n in range(5) for k in range(6)]
    published = publish(kafka_config, created.topic, items)
    recorder = Recorder(hold="k0-4", block_key="k0")
    subscribers = [Subscriber(kafka_config, redis_url=endpoints.redis_url) for _ in range(3)]
    futures = [s.subscribe(created.subscription, recorder) for s in subscribers]
    try:
        wait_until(lambda: sum(recorder.acked.values()) == len(items) - 1 and len(recorder.held) == 1, 90,
                   "every message but the held one acked")
        wait_until(lambda: all(f.engine.assigned_partitions() for f in futures), 60, "one partition each")
        assert sorted(p for f in futures for p in f.engine.assigned_partitions()) == [0, 1, 2]

        started = time.monotonic()
        result = admin.seek(created.subscription, time=before, timeout=60)
        elapsed = time.monotonic() - started

        assert result.applied_by_subscribers == 3 and result.applied_by_admin == 0
        assert elapsed < 15, f"seek took {elapsed:.1f} s"
        [stale] = recorder.held
        assert stale.ack_with_response().result(30) is AckResponse.LEASE_LOST
        store = StateStore(endpoints.redis_url)
        settled = store.client.zrange(partition_keys(created.subscription, stale.partition())[1], 0, -1)
        assert str(stale.offset()).encode() not in settled
        recorder.release.set()
        wait_until(lambda: len(recorder.replays()) >= len(items), 90, "every message delivered again")
        wait_until(lambda: sum(recorder.acked.values()) == 2 * len(items) - 1, 60, "the replay acked")
    finally:
        recorder.release.set()
        for future in futures:
            future.cancel()
    replays = recorder.replays()
    assert Counter(data for _, data, _, _ in replays) == Counter(data for _, data, _ in published)
    order: dict[str, list[str]] = {}
    for key, data, _, _ in replays:
        order.setdefault(key, []).append(data)
    assert order == {f"k{k}": [f"k{k}-{n}" for n in range(5)] for k in range(6)}
    assert {attempt for _, _, attempt, _ in replays} == {1}


def test_a_seek_pending_when_a_partition_is_claimed_is_applied_at_claim(
        admin: Admin, kafka_config: dict[str, Any], endpoints: Endpoints,
        subscription_factory: Callable[..., CreatedSubscription]) -> None:
    """GRP-3: a seek recorded while no subscriber runs and not applied by the admin (as after an admin
    that stopped waiting) is applied by the subscriber that next claims the partition: it starts at the
    seek's target instead of the committed offset, keeps the seek's settled set, and marks it applied."""
    created = subscription_factory(partitions=1, retry_policy=NO_BACKOFF)
    publish(kafka_config, created.topic, [(key, f"{key}{n}") for n in range(3) for key in "ab"])
    replay(kafka_config, endpoints, created.subscription, 6)  # all acked: committed offset 6
    store = StateStore(endpoints.redis_url)
    # a0 a1 a2 / b0 b1 b2 interleaved: a0=0 b0=1 a1=2 b1=3 a2=4 b2=5. Back to 1 with a1 and b2 settled.
    generation = store.post_seek(created.subscription, {0: (1, (2, 5))})
    assert store.seek_status(created.subscription, [0])[0].pending
    assert [p.pending_seek for p in admin.describe_subscription(created.subscription).partitions] == [generation]

    got = replay(kafka_config, endpoints, created.subscription, 3)

    assert by_key(got) == {"a": ["a2"], "b": ["b0", "b1", "b2"]}
    assert {m.delivery_attempt for m in got} == {1}
    wait_until(lambda: store.seek_status(created.subscription, [0])[0].applied == generation, 30, "marked applied")
    assert [p.pending_seek for p in admin.describe_subscription(created.subscription).partitions] == [0]


def test_seek_to_a_snapshot_while_pulling(admin: Admin, kafka_config: dict[str, Any], endpoints: Endpoints,
                                          subscription_factory: Callable[..., CreatedSubscription],
                                          unique_name: Callable[[str], str]) -> None:
    """GRP-3, SUB-4, ACK-6: a pulling subscriber acks out of order above the committed offset and nacks a
    message twice; a snapshot keeps that state; after everything was acked, a seek to the snapshot is
    applied by the running subscriber: the keys with an unacked message then are delivered again from
    it (acked later messages included, by cascade), the fully acked key is not, attempts start at 1."""
    created = subscription_factory(partitions=1, retry_policy=NO_BACKOFF, ack_deadline=60)
    # a0=0 b0=1 c0=2 a1=3 b1=4 c1=5 a2=6 b2=7 c2=8
    publish(kafka_config, created.topic, [(key, f"{key}{n}") for n in range(3) for key in "abc"])
    name = unique_name("snap")
    with Subscriber(kafka_config, redis_url=endpoints.redis_url) as subscriber:
        def pull(count: int) -> dict[str, Message]:
            return {m.data.decode(): m for m in pull_until(subscriber, created.subscription, count)}

        first = pull(9)
        for data in ("b0", "b1", "b2", "a1", "c1"):
            assert first[data].ack_with_response().result(30) is AckResponse.SUCCESS
        first["c0"].nack()
        second = pull(3)  # c0 c1 c2 again (cascade), attempt 2
        assert {m.delivery_attempt for m in second.values()} == {2}
        assert second["c1"].ack_with_response().result(30) is AckResponse.SUCCESS
        snapshot = admin.create_snapshot(name, created.subscription)
        assert [(p.committed, p.settled) for p in snapshot.partitions] == [(0, (1, 3, 4, 5, 7))]
        for message in (first["a0"], first["a2"], second["c0"], second["c2"]):
            assert message.ack_with_response().result(30) is AckResponse.SUCCESS

        result = admin.seek(created.subscription, snapshot=name, timeout=60)

        assert result.applied_by_subscribers == 1
        got = pull_until(subscriber, created.subscription, 6, ack=True)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            got.extend(subscriber.pull(created.subscription, max_messages=10, timeout=0.2))
    assert by_key(got) == {"a": ["a0", "a1", "a2"], "c": ["c0", "c1", "c2"]}
    assert {m.delivery_attempt for m in got} == {1}
    admin.delete_snapshot(name)


def test_a_seek_not_applied_in_time_raises_and_stays_pending(
        admin: Admin, kafka_config: dict[str, Any], endpoints: Endpoints,
        subscription_factory: Callable[..., CreatedSubscription]) -> None:
    """GRP-3: while the group's only member does not apply seeks (a plain Kafka consumer), the admin
    may not apply it either: the seek times out naming the partitions; it stays pending, and the
    subscriber that next claims them applies it (here a purge: only later messages come)."""
    created = subscription_factory(partitions=2, retry_policy=NO_BACKOFF)
    publish(kafka_config, created.topic, [(f"k{k}", f"old{k}") for k in range(4)])
    plain = Consumer({**kafka_config, "group.id": created.subscription, "enable.auto.commit": False})
    try:
        plain.subscribe([created.topic])
        deadline = time.monotonic() + 60
        while len(plain.assignment()) < 2:
            assert time.monotonic() < deadline, "the plain consumer was never assigned both partitions"
            plain.poll(0.2)
        with pytest.raises(SeekTimeoutError) as raised:
            admin.seek(created.subscription, time=datetime.now(UTC) + timedelta(seconds=1), timeout=3)
    finally:
        plain.close()
    assert raised.value.partitions == (0, 1)
    store = StateStore(endpoints.redis_url)
    assert all(s.pending for s in store.seek_status(created.subscription, [0, 1]).values())
    publish(kafka_config, created.topic, [("k0", "new0"), ("k1", "new1")])
    got = replay(kafka_config, endpoints, created.subscription, 2)
    assert sorted(m.data.decode() for m in got) == ["new0", "new1"]
    assert not any(s.pending for s in store.seek_status(created.subscription, [0, 1]).values())
