"""Prometheus metrics scraped from the HTTP endpoint during real runs (Kafka and Redis of the session)."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ordering_layer import DeadLetterPolicy, Message, OrderedConsumer, OrderedProducer, Subscriber, metrics
from ordering_layer.subscriber.engine import Engine
from tests.checker import DeliveryChecker, wait_until
from tests.integration.conftest import publish_keys, recording_callback

pytestmark = pytest.mark.integration

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def endpoint() -> Iterator[metrics.MetricsServer]:
    server = metrics.start_metrics_server(0, "127.0.0.1")
    yield server
    server.close()


def scrape(server: metrics.MetricsServer) -> Samples:
    """Every sample on the endpoint, by (name, labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def test_producer_publish_latency_and_paused_keys(kafka_config: dict[str, Any], topic_factory: Callable[..., str],
                                                 endpoint: metrics.MetricsServer) -> None:
    """PUB-2, PUB-3: the producer's endpoint shows one publish-latency sample per record at an offset
    that is a multiple of 64, and a key paused by a failed (purged) publish."""
    topic = topic_factory(partitions=1)
    with OrderedProducer(kafka_config, metrics_port=endpoint.port) as producer:
        results = [f.result(timeout=60) for f in
                   [producer.publish(topic, b"x", ordering_key=f"k{i % 5}") for i in range(130)]]
        expected = sum(1 for r in results if r.offset % 64 == 0)
        assert expected == 3
        samples = scrape(endpoint)
        assert sample(samples, "ordering_layer_publish_latency_seconds_count", topic=topic) == expected
        latency_sum = sample(samples, "ordering_layer_publish_latency_seconds_sum", topic=topic)
        assert latency_sum is not None and 0 < latency_sum < 3 * 30
        assert sample(samples, "ordering_layer_paused_ordering_keys") == 0
    with OrderedProducer({**kafka_config, "linger.ms": 2000}, metrics_port=endpoint.port) as lingering:
        future = lingering.publish(topic, b"never sent", ordering_key="doomed")
        lingering.purge(in_flight=False)
        assert future.exception(timeout=30) is not None
        assert sample(scrape(endpoint), "ordering_layer_paused_ordering_keys") == 1
    assert sample(scrape(endpoint), "ordering_layer_paused_ordering_keys") == 0  # closed: unregistered


@pytest.mark.skipif(not hasattr(Engine, "metrics_snapshot"), reason="the engine has no metrics_snapshot() yet")
def test_subscriber_metrics_during_a_run_with_nacks_and_a_dead_letter(
        kafka_config: dict[str, Any], endpoints: Any, subscription: Callable[..., tuple[str, str]],
        unique_name: Callable[[str], str], endpoint: metrics.MetricsServer) -> None:
    """SUB-3, SUB-4, DLQ-2, ACK-6: scraped during a run in which one message is nacked until it is
    dead-lettered and another is nacked once, the counters equal what the callback did, the
    ack-latency histogram counts the acks, and outstanding and backlog fall to 0."""
    topic, name = subscription(partitions=2, dead_letter_policy=DeadLetterPolicy(unique_name("dlq"),
                                                                                  max_delivery_attempts=5))
    checker = DeliveryChecker()
    ids: dict[str, list[str]] = {f"key-{k}": [] for k in range(3)}
    with OrderedProducer(kafka_config) as producer:
        futures = [(key, producer.publish(topic, f"{key}:{n}".encode(), ordering_key=key))
                   for n in range(4) for key in ids]
        for key, published in futures:
            ids[key].append(published.result(timeout=60).message_id)
    for key, message_ids in ids.items():
        checker.expect(key, message_ids)
    poison, flaky = ids["key-1"][1], ids["key-2"][0]

    def handler(message: Message) -> str:
        if message.message_id == poison or (message.message_id == flaky and message.delivery_attempt == 1):
            return "nack"
        return "ack"

    labels = {"subscription": name, "topic": topic}
    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with subscriber.subscribe(name, recording_callback(checker, "s1", handler)) as streaming:
        metrics.register(streaming.engine, kafka_config=kafka_config)
        try:
            wait_until(lambda: checker.acked_count() == 11, 60, "all but the poison acked")
            acks = sum(1 for e in checker.events if e.action == "ack")
            nacks = sum(1 for e in checker.events if e.action == "nack")
            deliveries = checker.deliveries()
            redeliveries = sum(1 for e in deliveries if e.attempt > 1)
            assert (acks, nacks, len(deliveries), redeliveries) == (11, 6, 17, 5)

            def settled() -> bool:
                samples = scrape(endpoint)
                return (sample(samples, "ordering_layer_messages_acked_total", **labels) == acks
                        and sample(samples, "ordering_layer_messages_dead_lettered_total", **labels) == 1
                        and sample(samples, "ordering_layer_outstanding_messages", **labels) == 0
                        and all(sample(samples, "ordering_layer_partition_backlog_messages", **labels,
                                       partition=str(p)) in (0, None) for p in range(2)))

            wait_until(settled, 60, "acks, the dead letter and the commits in the metrics")
            samples = scrape(endpoint)
            assert sample(samples, "ordering_layer_messages_delivered_total", **labels) == len(deliveries)
            assert sample(samples, "ordering_layer_messages_nacked_total", **labels) == nacks
            assert sample(samples, "ordering_layer_messages_redelivered_total", **labels) == redeliveries
            assert sample(samples, "ordering_layer_ack_latency_seconds_count", **labels) == acks
            assert sample(samples, "ordering_layer_held_keys", **labels) == 0
            assert sample(samples, "ordering_layer_lease_lapses_total", **labels) == 0
            owned = [p for p in range(2) if sample(samples, "ordering_layer_partition_backlog_messages", **labels,
                                                   partition=str(p)) is not None]
            assert owned == [0, 1]
            flushes = sample(samples, "ordering_layer_redis_flush_seconds_count", **labels)
            assert flushes is not None and flushes >= 1
        finally:
            metrics.unregister(streaming.engine)


def test_ordered_consumer_serves_its_metrics(kafka_config: dict[str, Any], endpoints: Any,
                                             subscription: Callable[..., tuple[str, str]],
                                             endpoint: metrics.MetricsServer) -> None:
    """SUB-1, ACK-4: ``OrderedConsumer(metrics_port=)`` exports its subscription like a ``Subscriber``:
    after consuming 6 messages (acked by auto-commit at the next poll) the endpoint counts 6
    deliveries and 6 acks, nothing outstanding; after close the counters stay in the totals."""
    topic, name = subscription(partitions=2)
    publish_keys(kafka_config, topic, keys=3, per_key=2)
    labels = {"subscription": name, "topic": topic}
    consumer = OrderedConsumer({**kafka_config, "group.id": name}, redis_url=endpoints.redis_url,
                               metrics_port=endpoint.port)
    try:
        consumer.subscribe([topic])
        got: list[Message] = []
        deadline = time.monotonic() + 60
        while len(got) < 6 and time.monotonic() < deadline:
            got += consumer.consume(6, timeout=0.5)
        assert len(got) == 6

        def counted() -> bool:
            consumer.poll(0)  # auto-commit acks what the last consume returned
            samples = scrape(endpoint)
            return (sample(samples, "ordering_layer_messages_delivered_total", **labels) == 6
                    and sample(samples, "ordering_layer_messages_acked_total", **labels) == 6
                    and sample(samples, "ordering_layer_outstanding_messages", **labels) == 0)

        wait_until(counted, 30, "the consumer's deliveries and acks on the endpoint")
    finally:
        consumer.close()
    assert sample(scrape(endpoint), "ordering_layer_messages_acked_total", **labels) == 6
