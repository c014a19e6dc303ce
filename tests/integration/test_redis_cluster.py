"""The layer on a real three-master Redis Cluster (ACK-4): a master killed and restarted mid-subscription,
the apply script reloaded on a restarted master, subscription state removed from every primary.

The cluster comes from the plugin's ``ordering_layer_redis_cluster`` fixture: the session's own when
it runs one (``make test-redis-cluster``), else three redis-servers started for this session.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

import pytest

from ordering_layer import Admin, Message, Subscriber
from ordering_layer.config import SubscriptionSettings
from ordering_layer.stack.redis_nodes import RedisNodes
from ordering_layer.state import ApplyResult, StateStore
from ordering_layer.state.store import KEEP_FIELD, Op, OpKind, offset_fields, partition_keys, settings_key
from tests.checker import wait_until
from tests.integration.conftest import NO_BACKOFF, publish_keys, recording_callback

pytestmark = [pytest.mark.integration, pytest.mark.redis_cluster]


@pytest.fixture(scope="module")
def cluster(ordering_layer_redis_cluster: RedisNodes) -> RedisNodes:
    """The three-master cluster, every master up."""
    ordering_layer_redis_cluster.up()
    return ordering_layer_redis_cluster


def partitions_on_every_master(cluster: RedisNodes, subscription: str, count: int = 3) -> dict[int, int]:
    """For each master, the first partition (of up to 64) whose keys it serves: {node: partition}."""
    found: dict[int, int] = {}
    for partition in range(64):
        found.setdefault(cluster.node_of(partition_keys(subscription, partition)[0]), partition)
        if len(found) == count:
            return found
    raise AssertionError(f"64 partitions of {subscription} do not reach every master: {found}")


def script_cached(cluster: RedisNodes, node: int) -> bool:
    source = (resources.files("ordering_layer.state") / "lua" / "apply.lua").read_text()
    sha = hashlib.sha1(source.encode()).hexdigest()
    client = cluster.node_client(node)
    try:
        return bool(client.execute_command("SCRIPT", "EXISTS", sha)[0])
    finally:
        client.close()


def test_master_killed_and_restarted_mid_subscription_loses_nothing(
        cluster: RedisNodes, kafka_config: dict[str, Any], topic_factory: Callable[..., str],
        unique_name: Callable[[str], str]) -> None:
    """ACK-4, SUB-1, SUB-3: the master serving a partition's state is killed with SIGKILL mid-stream; the
    cluster goes down (every other master sees it fail) and comes back when the master restarts from
    its append-only file: every message is acked, in per-key order, none lost."""
    topic = topic_factory(partitions=3)
    name = unique_name("sub")
    admin = Admin(kafka_config, redis_url=cluster.url())
    admin.create_subscription(name, topic=topic, retry_policy=NO_BACKOFF)
    checker = publish_keys(kafka_config, topic, keys=40, per_key=40)
    victim = cluster.node_of(partition_keys(name, 0)[0])
    restarted = threading.Event()

    def handler(message: Message) -> str:
        time.sleep(0.002)
        return "ack"

    try:
        subscriber = Subscriber(kafka_config, redis_url=cluster.url())
        with subscriber.subscribe(name, recording_callback(checker, "s1", handler), max_workers=4):
            wait_until(lambda: checker.acked_count() >= checker.total() // 3, 60, "a third acked")
            cluster.stop_node(victim, kill=True)
            wait_until(cluster.cluster_failed, 60, "the other masters to declare the killed one failed")
            acked_during_outage = checker.acked_count()
            cluster.start_node(victim)
            cluster.wait_cluster_ok()
            restarted.set()
            wait_until(lambda: checker.acked_count() == checker.total(), 180, "every message acked after the restart")
        assert acked_during_outage < checker.total(), "the master died after the stream had ended"
        assert checker.verify() == []
        wait_until(lambda: admin.describe_subscription(name).backlog == 0, 60, "offsets committed")
    finally:
        cluster.up()
        admin.delete_subscription(name)


def test_apply_reloads_its_script_on_a_restarted_master_only_where_refused(
        cluster: RedisNodes, unique_name: Callable[[str], str]) -> None:
    """ACK-4: one pipeline writes partitions held by all three masters; after one master restarts (its
    script cache empty) the pipeline's NOSCRIPT answers are reloaded and resent, and every batch is
    applied exactly as on a fresh store (claim's script reloads too)."""
    store = StateStore(cluster.url())
    name = unique_name("lua")
    where = partitions_on_every_master(cluster, name)
    epochs = {partition: store.claim(name, partition).epoch for partition in where.values()}
    deliver: list[Op] = [(OpKind.DELIVERED, 10, 1), (OpKind.LEASE, 10, 5000)]
    batch = [(name, p, epochs[p], deliver) for p in where.values()]
    assert store.apply_many(batch) == [ApplyResult.APPLIED] * 3
    assert all(script_cached(cluster, node) for node in where)

    victim = next(iter(where))
    cluster.stop_node(victim, kill=True)
    cluster.start_node(victim)
    cluster.wait_cluster_ok()
    assert not script_cached(cluster, victim)

    ack_and_deliver: list[Op] = [(OpKind.SETTLED, 10, 0), (OpKind.DELIVERED, 11, 2)]
    settle = [(name, p, epochs[p], ack_and_deliver) for p in where.values()]
    assert store.apply_many(settle) == [ApplyResult.APPLIED] * 3
    assert script_cached(cluster, victim)
    for partition in where.values():
        _, settled, attempts, leases = partition_keys(name, partition)
        assert {int(o) for o in store.client.zrange(settled, 0, -1)} == {10}
        fields = store.client.hgetall(attempts)
        assert {int(k): int(v) for k, v in fields.items() if k != KEEP_FIELD.encode()} == {11: 2}
        assert offset_fields(store.client.hkeys(leases)) == []
    claimed = store.claim(name, where[victim])
    assert claimed.epoch > epochs[where[victim]] and claimed.settled == frozenset({10})
    store.delete_subscription(name)


def test_delete_subscription_scans_every_primary_and_spares_lookalike_names(
        cluster: RedisNodes, unique_name: Callable[[str], str]) -> None:
    """ACK-4: deleting a subscription removes its settings, parked keys and the state of partitions held
    by every master, and nothing of a subscription whose name merely starts the same way."""
    store = StateStore(cluster.url())
    name = unique_name("del")
    lookalike = f"{name}:1"
    settings = SubscriptionSettings(topic="t")
    where = partitions_on_every_master(cluster, name)
    for subscription in (name, lookalike):
        store.create_settings(subscription, settings)
        store.park_key(subscription, b"parked-key")
        for partition in where.values():
            store.claim(subscription, partition)

    def stored(subscription: str) -> set[bytes]:
        return {key.encode() for key in (settings_key(subscription), f"{settings_key(subscription)}:parked",
                                         *(partition_keys(subscription, p)[0] for p in where.values()))}

    def on_the_nodes() -> set[bytes]:
        found: set[bytes] = set()
        for node in range(cluster.count):
            client = cluster.node_client(node)
            try:
                found.update(k for k in client.scan_iter(match="ol:*", count=1000) if name.encode() in k)
            finally:
                client.close()
        return found

    assert on_the_nodes() == stored(name) | stored(lookalike)
    assert store.delete_subscription(name) == len(stored(name)) == 5
    assert on_the_nodes() == stored(lookalike)
    assert store.settings(lookalike) == settings and store.parked_keys(lookalike) == {b"parked-key"}
    assert store.delete_subscription(lookalike) == 5
    assert on_the_nodes() == set()


def test_seek_state_spans_every_master(cluster: RedisNodes, unique_name: Callable[[str], str]) -> None:
    """GRP-3 on a cluster: a seek recorded for partitions served by every master is pending on each,
    each claim applies it within its own slot, the admin's re-claim marks it applied, and deleting
    the subscription removes the seek keys from every primary."""
    store = StateStore(cluster.url())
    name = unique_name("seek")
    where = partitions_on_every_master(cluster, name)
    partitions = sorted(where.values())
    generation = store.post_seek(name, {p: (5, (6, 9)) for p in partitions})
    assert store.seek_announced(name) == generation
    assert all(s.pending for s in store.seek_status(name, partitions).values())
    first, *rest = partitions
    claimed = store.claim(name, first)
    assert (claimed.seek_offset, claimed.settled) == (5, frozenset({6, 9}))
    reclaimed = store.claim_for_seek(name, store.epochs(name, rest), mark_applied=True, generation=generation)
    assert sorted(reclaimed) == rest and all(c is not None for c in reclaimed.values())
    assert store.seek_applied(name, first, claimed.epoch, generation)
    assert not any(s.pending for s in store.seek_status(name, partitions).values())
    assert store.settled_from(name, {p: 6 for p in partitions}) == {p: (6, [6, 9]) for p in partitions}
    store.delete_subscription(name)
    assert all(not s.generation for s in store.seek_status(name, partitions).values())
