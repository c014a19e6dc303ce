"""The three-broker cluster of the local stack: replication, broker kills and a leader failover.

Every test here uses the session's opt-in ``kafka_cluster`` (3 combined broker + controller nodes,
its own Redis); a test starts from a cluster with every broker up and every replica in sync.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from click.testing import CliRunner
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, ClusterMetadata  # type: ignore[attr-defined]

from ordering_layer import Admin, Message, OrderedProducer, PublishResult, Subscriber
from ordering_layer.cli import main
from ordering_layer.stack import Endpoints, LocalStack
from tests.checker import DeliveryChecker, wait_until
from tests.integration.conftest import NO_BACKOFF
from tests.kafka_helpers import end_offsets

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

_LOGGER = logging.getLogger(__name__)

KEYS = 20
PER_KEY = 150


def _admin_client(endpoints: Endpoints) -> AdminClient:
    return AdminClient({**endpoints.kafka_config(),
                        "logger": logging.getLogger("ordering_layer.kafka.client")})  # type: ignore[dict-item]


def _metadata(client: AdminClient, topic: str | None = None) -> ClusterMetadata | None:
    """The cluster's metadata, or None when no broker answered in time (one may have just died)."""
    try:
        return client.list_topics(topic, timeout=10)
    except KafkaException:
        return None


def _brokers(client: AdminClient) -> dict[int, str]:
    """Alive brokers by node id, with their ``host:port``."""
    metadata = _metadata(client)
    return {node: f"{b.host}:{b.port}" for node, b in metadata.brokers.items()} if metadata else {}


def _under_replicated(client: AdminClient) -> list[str]:
    """Partitions (internal topics included) whose in-sync replicas are fewer than their replicas."""
    metadata = _metadata(client)
    if metadata is None:
        return ["(no metadata)"]
    return [f"{name}-{p.id}" for name, topic in metadata.topics.items() for p in topic.partitions.values()
            if p.leader < 0 or len(p.isrs) < len(p.replicas)]


def _leader(client: AdminClient, topic: str, partition: int) -> int:
    """The partition's leader, -1 while it has none (or no broker answered)."""
    metadata = _metadata(client, topic)
    return int(metadata.topics[topic].partitions[partition].leader) if metadata else -1


@pytest.fixture
def cluster(kafka_cluster: LocalStack) -> LocalStack:
    """The session's cluster with every broker running and every replica in sync (a failed test may
    have left a broker down or behind)."""
    kafka_cluster.start_broker()
    client = _admin_client(kafka_cluster.endpoints())
    wait_until(lambda: len(_brokers(client)) == 3 and not _under_replicated(client), 120,
               "3 brokers with every replica in sync", interval=0.5)
    return kafka_cluster


def test_cluster_has_three_brokers_and_topics_keep_three_replicas(cluster: LocalStack,
                                                                  unique_name: Callable[[str], str]) -> None:
    """The cluster: three brokers on the addresses of the bootstrap list; a new topic, and the
    internal offsets topic, have 3 replicas and min.insync.replicas=2, so one broker may fail."""
    endpoints = cluster.endpoints()
    addresses = endpoints.bootstrap.split(",")
    assert len(addresses) == 3
    status = cluster.status()
    assert status["up"] and [b["node"] for b in status["kafka"]["brokers"]] == [1, 2, 3]
    assert [b["address"] for b in status["kafka"]["brokers"]] == addresses
    assert _brokers(_admin_client(endpoints)) == dict(zip([1, 2, 3], addresses, strict=True))

    admin = Admin(endpoints.kafka_config(), redis_url=endpoints.redis_url)
    topic = admin.create_topic(unique_name("rf3"), partitions=3)
    assert (topic.replication_factor, topic.config["min.insync.replicas"]) == (3, "2")
    chosen = admin.create_topic(unique_name("rf3-isr3"), config={"min.insync.replicas": "3"})
    assert (chosen.replication_factor, chosen.config["min.insync.replicas"]) == (3, "3")
    admin.create_subscription(unique_name("sub"), topic=topic.name)  # commits offsets: __consumer_offsets
    offsets = admin.describe_topic("__consumer_offsets")
    assert (offsets.replication_factor, offsets.config["min.insync.replicas"]) == (3, "2")


def test_kill_9_and_restart_a_broker_through_the_api_and_the_cli(cluster: LocalStack,
                                                                 unique_name: Callable[[str], str]) -> None:
    """A broker killed with SIGKILL (API, then CLI) leaves two that still take acks=all publishes; it
    restarts with its id, address and data and rejoins every in-sync replica set."""
    endpoints = cluster.endpoints()
    client = _admin_client(endpoints)
    addresses = _brokers(client)
    admin = Admin(endpoints.kafka_config())
    topic = admin.create_topic(unique_name("kill"), partitions=3).name
    state_dir = str(cluster.status()["state_dir"])
    meta = cluster.state_dir / "broker-2" / "data" / "meta.properties"
    formatted = meta.read_text()

    with OrderedProducer(endpoints.kafka_config()) as producer:
        producer.publish(topic, b"before", ordering_key="k").result(timeout=60)
        cluster.stop_broker(node=2, kill=True)
        assert [b["running"] for b in cluster.status()["kafka"]["brokers"]] == [True, False, True]
        wait_until(lambda: set(_brokers(client)) == {1, 3}, 60, "broker 2 fenced", interval=0.5)
        producer.publish(topic, b"with two", ordering_key="k").result(timeout=120)
    cluster.start_broker(node=2)
    wait_until(lambda: _brokers(client) == addresses, 60, "broker 2 at its address", interval=0.5)
    assert meta.read_text() == formatted  # the same storage, not a new one
    wait_until(lambda: not _under_replicated(client), 120, "broker 2 back in sync", interval=0.5)

    runner = CliRunner()
    killed = runner.invoke(main, ["stack", "kill-broker", "3", "--state-dir", state_dir])
    assert killed.exit_code == 0, killed.output
    shown = runner.invoke(main, ["stack", "status", "--state-dir", state_dir])
    assert shown.exit_code == 1  # not every service runs
    brokers = json.loads(shown.output)["kafka"]["brokers"]
    assert [(b["node"], b["running"]) for b in brokers] == [(1, True), (2, True), (3, False)]
    started = runner.invoke(main, ["stack", "start-broker", "3", "--state-dir", state_dir])
    assert started.exit_code == 0, started.output
    wait_until(lambda: _brokers(client) == addresses, 60, "broker 3 at its address", interval=0.5)
    wait_until(lambda: not _under_replicated(client), 120, "broker 3 back in sync", interval=0.5)
    missing = runner.invoke(main, ["stack", "kill-broker", "4", "--state-dir", state_dir])
    assert missing.exit_code != 0 and "no broker 4" in missing.output
    assert sum(end_offsets(endpoints.kafka_config(), topic).values()) == 2


def test_partition_leader_killed_during_publish_and_subscribe_loses_nothing(
        cluster: LocalStack, unique_name: Callable[[str], str]) -> None:
    """SUB-1, SUB-3 (issue 12's failover proof): on 3 brokers, an OrderedProducer publishes 20 keys
    while a Subscriber acks. The leader of partition 0 is killed with SIGKILL after the first third
    is sent (not all of it confirmed); the second third is published, and the first two delivered
    and acked, while it is down; it restarts before the last third. Every message is published once
    (the log holds no duplicate), delivered and acked (SUB-3); each key's deliveries move forward in
    publish order, one outstanding at a time, redeliveries only as cascades (SUB-1, SUB-4)."""
    endpoints = cluster.endpoints()
    config = endpoints.kafka_config()
    client = _admin_client(endpoints)
    admin = Admin(config, redis_url=endpoints.redis_url)
    topic, name = unique_name("failover"), unique_name("sub")
    admin.create_topic(topic, partitions=3)
    admin.create_subscription(name, topic=topic, retry_policy=NO_BACKOFF)
    keys = [f"key-{k}" for k in range(KEYS)]
    checker = DeliveryChecker()
    for key in keys:  # a message is named by its payload, known before it is published
        checker.expect(key, [f"{key}:{n}" for n in range(PER_KEY)])
    victim = _leader(client, topic, 0)
    first_sent, killed, second_confirmed, restarted = (threading.Event() for _ in range(4))

    def publish() -> None:
        with OrderedProducer(config) as producer:
            futures: list[Future[PublishResult]] = []

            def send(rounds: range) -> None:
                futures.extend(producer.publish(topic, f"{key}:{n}".encode(), ordering_key=key)
                               for n in rounds for key in keys)

            def confirm() -> None:
                for future in futures:
                    future.result(timeout=300)

            third = PER_KEY // 3
            send(range(third))
            first_sent.set()
            assert killed.wait(300), "the leader was not killed"
            send(range(third, 2 * third))
            confirm()
            second_confirmed.set()
            assert restarted.wait(300), "the leader was not restarted"
            send(range(2 * third, PER_KEY))
            confirm()

    def callback(message: Message) -> None:
        payload = message.data.decode()
        checker.record(payload, "s1", message.delivery_attempt, "deliver")
        checker.record(payload, "s1", message.delivery_attempt, "ack")
        message.ack()

    streaming = Subscriber(config, redis_url=endpoints.redis_url).subscribe(name, callback, max_workers=4)
    with ThreadPoolExecutor(1) as pool, streaming:
        publishing = pool.submit(publish)
        try:
            wait_until(lambda: first_sent.is_set() and checker.acked_count() >= 100, 120,
                       "a third sent and 100 acked")
            cluster.stop_broker(node=victim, kill=True)
            killed_at = time.monotonic()
            killed.set()
            wait_until(lambda: _leader(client, topic, 0) not in (victim, -1), 60, "a new leader of partition 0",
                       interval=0.5)
            new_leader_after = time.monotonic() - killed_at
            wait_until(lambda: second_confirmed.is_set() or publishing.done(), 300,
                       "two thirds published with the leader down", interval=0.5)
            assert second_confirmed.is_set(), publishing.exception()
            wait_until(lambda: checker.acked_count() == 2 * checker.total() // 3, 180,
                       "two thirds acked with the leader down", interval=0.5)
            caught_up_after = time.monotonic() - killed_at
            cluster.start_broker(node=victim)
        finally:
            killed.set()
            restarted.set()
        publishing.result(timeout=300)
        wait_until(lambda: checker.acked_count() == checker.total()
                   and admin.describe_subscription(name).backlog == 0, 180, "every message acked",
                   interval=0.5)
    _LOGGER.info("failover of broker %d: new leader after %.1f s, two thirds acked after %.1f s; "
                 "%d deliveries of %d messages", victim, new_leader_after, caught_up_after,
                 len(checker.deliveries()), checker.total())
    assert sum(end_offsets(endpoints.kafka_config(), topic).values()) == checker.total()
    assert checker.verify() == []
