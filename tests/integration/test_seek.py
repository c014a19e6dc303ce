"""Seek to a time or a snapshot, and snapshots (GRP-3), against the real broker and Redis.

Subscribers here are stopped before each seek (an empty group: the admin applies it); seeks during
a running subscription are in ``test_seek_running.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from click.testing import CliRunner
from confluent_kafka import Consumer, TopicPartition

from ordering_layer import Admin, Message, OrderedProducer, RetryPolicy, Subscriber
from ordering_layer.cli import main
from ordering_layer.errors import ConfigError, SnapshotExistsError, SnapshotNotFoundError
from ordering_layer.kafka.offsets import partition_offsets, tagged_generation
from ordering_layer.pytest_plugin import CreatedSubscription
from ordering_layer.stack import Endpoints
from tests.checker import wait_until
from tests.integration.conftest import pull_until

pytestmark = pytest.mark.integration

NO_BACKOFF = RetryPolicy(minimum_backoff=0, maximum_backoff=0)


def publish(kafka_config: dict[str, Any], topic: str, items: list[tuple[str, str]]) -> list[tuple[str, str, int]]:
    """Publish (key, data) pairs in order; return (key, data, enqueued ms) of each."""
    with OrderedProducer(kafka_config) as producer:
        futures = [(key, data, producer.publish(topic, data.encode(), ordering_key=key)) for key, data in items]
        return [(key, data, int(f.result(60).enqueued_time.timestamp() * 1000)) for key, data, f in futures]


def drain(kafka_config: dict[str, Any], endpoints: Endpoints, subscription: str, count: int,
          decide: Callable[[Message], str] = lambda m: "ack") -> list[Message]:
    """Pull ``count`` messages with a new subscriber, settle each as ``decide`` says (ack, nack or
    keep), wait until Redis has the acks, and close the subscriber (an empty group again)."""
    with Subscriber(kafka_config, redis_url=endpoints.redis_url) as subscriber:
        got = pull_until(subscriber, subscription, count, timeout=60)
        futures = []
        for message in got:
            action = decide(message)
            if action == "ack":
                futures.append(message.ack_with_response())
            elif action == "nack":
                message.nack()
        for future in futures:
            future.result(30)
        # Close only with nothing outstanding, so that it does not wait out the kept messages' leases.
        for message in got:
            if decide(message) == "keep":
                message.nack()
    return got


def replay(kafka_config: dict[str, Any], endpoints: Endpoints, subscription: str, count: int,
           quiet: float = 2.0) -> list[Message]:
    """Pull and ack ``count`` messages, then check that nothing more comes within ``quiet`` s."""
    with Subscriber(kafka_config, redis_url=endpoints.redis_url) as subscriber:
        got = pull_until(subscriber, subscription, count, timeout=60, ack=True)
        deadline = time.monotonic() + quiet
        while time.monotonic() < deadline:
            got.extend(subscriber.pull(subscription, max_messages=100, timeout=0.2))
    return got


def by_key(messages: list[Message]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for message in messages:
        out.setdefault(message.ordering_key, []).append(message.data.decode())
    return out


def committed(kafka_config: dict[str, Any], subscription: str, topic: str,
              partitions: int) -> dict[int, tuple[int, int]]:
    """Per partition (committed offset, log end)."""
    consumer = Consumer({**kafka_config, "group.id": subscription, "enable.auto.commit": False})
    try:
        return {row.partition: (row.committed or 0, row.end)
                for row in partition_offsets(consumer, topic, list(range(partitions)), 30)}
    finally:
        consumer.close()


def test_seek_back_in_time_replays_acked_messages_in_key_order(
        admin: Admin, kafka_config: dict[str, Any], endpoints: Endpoints,
        subscription_factory: Callable[..., CreatedSubscription]) -> None:
    """GRP-3, SUB-4, ACK-6: after every message was acked, a seek back to a time between two batches
    (no subscriber running: the admin applies it) delivers again exactly the messages published
    after the time, each key in order from its first one after the time, with delivery attempt 1."""
    created = subscription_factory(partitions=2, retry_policy=NO_BACKOFF)
    first = publish(kafka_config, created.topic, [(f"k{k}", f"k{k}-{n}") for n in range(3) for k in range(4)])
    wait_until(lambda: datetime.now(UTC).timestamp() * 1000 > max(ms for _, _, ms in first) + 5, 10, "clock")
    when = datetime.now(UTC)
    publish(kafka_config, created.topic, [(f"k{k}", f"k{k}-{n}") for n in range(3, 6) for k in range(4)])
    drain(kafka_config, endpoints, created.subscription, 24)

    result = admin.seek(created.subscription, time=when, timeout=60)

    assert result.applied_by_admin == 2 and result.applied_by_subscribers == 0
    assert result.rewound == 12
    got = replay(kafka_config, endpoints, created.subscription, 12)
    assert by_key(got) == {f"k{k}": [f"k{k}-{n}" for n in range(3, 6)] for k in range(4)}
    assert {m.delivery_attempt for m in got} == {1}


def test_seek_forward_purges_the_backlog(admin: Admin, kafka_config: dict[str, Any], endpoints: Endpoints,
                                         subscription_factory: Callable[..., CreatedSubscription]) -> None:
    """GRP-3: a seek to a time after the last message marks the whole backlog acked: nothing of it is
    delivered, the committed offsets are the log ends (tagged with the seek), later messages come."""
    created = subscription_factory(partitions=3, retry_policy=NO_BACKOFF)
    publish(kafka_config, created.topic, [(f"k{k}", f"old-{k}-{n}") for n in range(5) for k in range(6)])

    result = admin.seek(created.subscription, time=datetime.now(UTC) + timedelta(seconds=1), timeout=60)

    assert result.skipped == 30 and result.applied_by_admin == 3
    offsets = committed(kafka_config, created.subscription, created.topic, 3)
    assert all(c == end for c, end in offsets.values())
    publish(kafka_config, created.topic, [("k0", "new-0"), ("k1", "new-1")])
    got = replay(kafka_config, endpoints, created.subscription, 2)
    assert sorted(m.data.decode() for m in got) == ["new-0", "new-1"]


def test_seek_to_a_snapshot_restores_exactly_the_unacked_set(
        admin: Admin, kafka_config: dict[str, Any], endpoints: Endpoints,
        subscription_factory: Callable[..., CreatedSubscription], unique_name: Callable[[str], str]) -> None:
    """GRP-3, SUB-4, ACK-6: a snapshot taken after out-of-order acks above the committed offset keeps
    them (but not an ack that a nack before it in its key voided); after everything was acked, a
    seek to it delivers again exactly what was unacked then (and, by cascade, the acked later
    messages of a key with an unacked one), with delivery attempt 1."""
    created = subscription_factory(partitions=1, retry_policy=NO_BACKOFF)
    # One partition, keys interleaved: a0 b0 c0 d0 a1 b1 c1 d1 a2 b2 c2 d2.
    publish(kafka_config, created.topic, [(key, f"{key}{n}") for n in range(3) for key in "abcd"])
    acked_before = {"a0", "a1", "a2", "c0", "d1"}  # b0 (offset 1) stays unacked: the rest is above the commit

    def decide(message: Message) -> str:
        return "ack" if message.data.decode() in acked_before else "keep"

    drain(kafka_config, endpoints, created.subscription, 12, decide)
    name = unique_name("snap")
    snapshot = admin.create_snapshot(name, created.subscription)
    [part] = snapshot.partitions
    assert part.committed == 1
    # c0, a1, a2; d1 (7) was acked, but the nack of d0 that ends the drain sends it out again (SUB-4),
    # so it is no longer settled.
    assert set(part.settled) == {2, 4, 8}
    drain(kafka_config, endpoints, created.subscription, 7)  # everything acked now
    assert committed(kafka_config, created.subscription, created.topic, 1)[0] == (12, 12)

    result = admin.seek(created.subscription, snapshot=name, timeout=60)

    assert result.applied_by_admin == 1
    got = replay(kafka_config, endpoints, created.subscription, 8)
    assert by_key(got) == {"b": ["b0", "b1", "b2"], "c": ["c1", "c2"], "d": ["d0", "d1", "d2"]}
    assert {m.delivery_attempt for m in got} == {1}
    admin.delete_snapshot(name)


def test_snapshot_expiry_list_and_delete(admin: Admin, subscription_factory: Callable[..., CreatedSubscription],
                                         unique_name: Callable[[str], str]) -> None:
    """GRP-3: snapshots are listed until they expire and can be deleted; an expired or deleted
    snapshot cannot be sought to; names are unique among live snapshots."""
    created = subscription_factory(partitions=1)
    short, kept = unique_name("short"), unique_name("kept")
    admin.create_snapshot(short, created.subscription, ttl=2.0)
    admin.create_snapshot(kept, created.subscription)
    assert {short, kept} <= {s.name for s in admin.list_snapshots()}
    with pytest.raises(SnapshotExistsError):
        admin.create_snapshot(kept, created.subscription)
    assert admin.get_snapshot(kept).expire_at > datetime.now(UTC) + timedelta(days=6, hours=23)

    wait_until(lambda: short not in {s.name for s in admin.list_snapshots()}, 30, "the short snapshot expired")
    with pytest.raises(SnapshotNotFoundError):
        admin.seek(created.subscription, snapshot=short, timeout=10)
    admin.create_snapshot(short, created.subscription)  # the name is free again

    admin.delete_snapshot(kept)
    assert kept not in {s.name for s in admin.list_snapshots()}
    with pytest.raises(SnapshotNotFoundError):
        admin.delete_snapshot(kept)
    admin.delete_snapshot(short)


def test_seek_refuses_bad_arguments(admin: Admin, subscription_factory: Callable[..., CreatedSubscription],
                                    unique_name: Callable[[str], str]) -> None:
    """GRP-3: a seek names exactly one of a timezone-aware time and a snapshot of the same topic."""
    one, other = subscription_factory(partitions=1), subscription_factory(partitions=1)
    with pytest.raises(ConfigError):
        admin.seek(one.subscription, timeout=5)
    with pytest.raises(ConfigError):
        admin.seek(one.subscription, time=datetime.now(), timeout=5)
    name = unique_name("snap")
    admin.create_snapshot(name, other.subscription)
    with pytest.raises(ConfigError):
        admin.seek(one.subscription, snapshot=name, timeout=5)
    admin.delete_snapshot(name)


def test_cli_snapshot_create_list_delete_and_seek(
        kafka_config: dict[str, Any], endpoints: Endpoints,
        subscription_factory: Callable[..., CreatedSubscription], unique_name: Callable[[str], str]) -> None:
    """GRP-3: ``snapshot create|list|delete`` and ``subscription seek --time|--snapshot`` on the CLI; the
    list is a table, the seek ends with its summary and tags the committed offsets."""
    created = subscription_factory(partitions=2)
    publish(kafka_config, created.topic, [(f"k{k}", f"m{k}") for k in range(6)])
    servers = ["--bootstrap", endpoints.bootstrap, "--redis-url", endpoints.redis_url]
    runner = CliRunner()
    name = unique_name("snap")

    made = runner.invoke(main, ["snapshot", "create", name, "--subscription", created.subscription, *servers])
    assert made.exit_code == 0, made.output
    assert f"snapshot {name} of {created.subscription}: 2 partitions" in made.output
    listed = runner.invoke(main, ["snapshot", "list", *servers])
    assert listed.exit_code == 0, listed.output
    lines = listed.output.splitlines()
    assert lines[0].split() == ["NAME", "SUBSCRIPTION", "TOPIC", "CREATED", "EXPIRES", "PARTITIONS", "ACKED", "ABOVE"]
    assert any(line.split()[:3] == [name, created.subscription, created.topic] for line in lines[2:])

    later = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
    sought = runner.invoke(main, ["subscription", "seek", created.subscription, "--time", later, *servers])
    assert sought.exit_code == 0, sought.output
    assert "applied by 2 of 2 partitions (0 by subscribers, 2 by the admin); rewound 0 offsets, skipped 6" in \
        sought.output
    back = runner.invoke(main, ["subscription", "seek", created.subscription, "--snapshot", name, *servers])
    assert back.exit_code == 0, back.output
    assert "rewound 6 offsets" in back.output
    consumer = Consumer({**kafka_config, "group.id": created.subscription})
    try:
        offsets = consumer.committed([TopicPartition(created.topic, p) for p in range(2)], timeout=30)
    finally:
        consumer.close()
    assert {tagged_generation(tp.metadata) for tp in offsets} == {2}

    both = runner.invoke(main, ["subscription", "seek", created.subscription, "--time", later, "--snapshot", name,
                                *servers])
    assert both.exit_code != 0 and "exactly one of --time and --snapshot" in both.output
    deleted = runner.invoke(main, ["snapshot", "delete", name, *servers])
    assert deleted.exit_code == 0 and f"deleted snapshot {name}" in deleted.output
    again = runner.invoke(main, ["snapshot", "delete", name, *servers])
    assert again.exit_code == 1 and "does not exist" in again.output
