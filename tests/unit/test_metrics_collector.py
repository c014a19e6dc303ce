"""Unit tests of the metrics collector against fake engines and producers (no Kafka, no Redis)."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from ordering_layer.metrics import LayerCollector


class FakeEngine:
    """An engine as the collector sees it: ``metrics_snapshot()``, ``subscription``, ``topic``."""

    def __init__(self, subscription: str = "sub", topic: str = "orders") -> None:
        self.subscription = subscription
        self.topic = topic
        self.counters = dict.fromkeys(("delivered", "acked", "nacked", "redelivered", "dead_lettered",
                                       "lease_extensions", "lease_lapses", "malformed_records"), 0)
        self.partitions: dict[int, dict[str, Any]] = {}
        self.ack_latencies: list[float] = []
        self.flushes: list[float] = []
        self.fail = False

    def metrics_snapshot(self) -> dict[str, Any]:
        if self.fail:
            raise RuntimeError("engine closed")
        acks, self.ack_latencies = self.ack_latencies, []
        flushes, self.flushes = self.flushes, []
        return {**self.counters,
                "outstanding": sum(p["outstanding"] for p in self.partitions.values()),
                "held_keys": sum(p["held_keys"] for p in self.partitions.values()),
                "partitions": {p: dict(v) for p, v in self.partitions.items()},
                "ack_latency_seconds": acks, "redis_flush_seconds": flushes}


class FakeProducer:
    def __init__(self) -> None:
        self.paused = 0
        self.samples: list[tuple[str, float]] = []

    def metrics_snapshot(self) -> dict[str, Any]:
        samples, self.samples = self.samples, []
        return {"paused_keys": self.paused, "publish_latency_seconds": samples}


@pytest.fixture
def registry() -> tuple[CollectorRegistry, LayerCollector]:
    collector = LayerCollector()
    registry = CollectorRegistry()
    registry.register(collector)
    return registry, collector


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_counters_gauges_and_partitions(registry: tuple[CollectorRegistry, LayerCollector]) -> None:
    """Counters and gauges of the snapshot appear under the documented names and labels."""
    reg, collector = registry
    engine = FakeEngine()
    engine.counters.update(delivered=7, acked=4, nacked=2, redelivered=2, dead_lettered=1, lease_extensions=3,
                           lease_lapses=1, malformed_records=5)
    engine.partitions = {0: {"outstanding": 2, "buffered": 9, "held_keys": 2, "oldest_unacked_seconds": 1.5},
                         1: {"outstanding": 1, "buffered": 0, "held_keys": 1, "oldest_unacked_seconds": 0.25}}
    collector.register(engine)
    sub = {"subscription": "sub", "topic": "orders"}
    assert value(reg, "ordering_layer_messages_delivered_total", **sub) == 7
    assert value(reg, "ordering_layer_messages_acked_total", **sub) == 4
    assert value(reg, "ordering_layer_messages_nacked_total", **sub) == 2
    assert value(reg, "ordering_layer_messages_redelivered_total", **sub) == 2
    assert value(reg, "ordering_layer_messages_dead_lettered_total", **sub) == 1
    assert value(reg, "ordering_layer_lease_extensions_total", **sub) == 3
    assert value(reg, "ordering_layer_lease_lapses_total", **sub) == 1
    assert value(reg, "ordering_layer_malformed_records_total", **sub) == 5
    assert value(reg, "ordering_layer_outstanding_messages", **sub) == 3
    assert value(reg, "ordering_layer_held_keys", **sub) == 3
    assert value(reg, "ordering_layer_partition_outstanding_messages", **sub, partition="0") == 2
    assert value(reg, "ordering_layer_partition_buffered_records", **sub, partition="0") == 9
    assert value(reg, "ordering_layer_partition_held_keys", **sub, partition="1") == 1
    assert value(reg, "ordering_layer_partition_oldest_unacked_age_seconds", **sub, partition="0") == 1.5
    assert value(reg, "ordering_layer_partition_backlog_messages", **sub, partition="0") is None  # no kafka_config


def test_histograms_accumulate_drained_observations(registry: tuple[CollectorRegistry, LayerCollector]) -> None:
    """Latencies handed over once are kept across scrapes; buckets are cumulative with inclusive bounds."""
    reg, collector = registry
    engine = FakeEngine()
    collector.register(engine)
    sub = {"subscription": "sub", "topic": "orders"}
    engine.ack_latencies = [0.004, 0.005, 2.0]
    assert value(reg, "ordering_layer_ack_latency_seconds_count", **sub) == 3
    engine.ack_latencies = [700.0]
    engine.flushes = [0.0004, 0.002]
    assert value(reg, "ordering_layer_ack_latency_seconds_count", **sub) == 4
    assert value(reg, "ordering_layer_ack_latency_seconds_bucket", **sub, le="0.005") == 2
    assert value(reg, "ordering_layer_ack_latency_seconds_bucket", **sub, le="2.5") == 3
    assert value(reg, "ordering_layer_ack_latency_seconds_bucket", **sub, le="600.0") == 3
    assert value(reg, "ordering_layer_ack_latency_seconds_bucket", **sub, le="+Inf") == 4
    assert value(reg, "ordering_layer_ack_latency_seconds_sum", **sub) == pytest.approx(702.009)
    assert value(reg, "ordering_layer_redis_flush_seconds_bucket", **sub, le="0.0005") == 1
    assert value(reg, "ordering_layer_redis_flush_seconds_count", **sub) == 2


def test_sources_with_equal_labels_are_summed_and_counters_survive_unregister(
        registry: tuple[CollectorRegistry, LayerCollector]) -> None:
    """Two subscribers of one subscription in one process add up; a closed one's counters stay."""
    reg, collector = registry
    first, second, other = FakeEngine(), FakeEngine(), FakeEngine("sub-2")
    first.counters["acked"], second.counters["acked"], other.counters["acked"] = 5, 6, 1
    first.partitions = {0: {"outstanding": 1, "buffered": 0, "held_keys": 1, "oldest_unacked_seconds": 3.0}}
    second.partitions = {0: {"outstanding": 2, "buffered": 0, "held_keys": 1, "oldest_unacked_seconds": 1.0}}
    for engine in (first, second, other):
        collector.register(engine)
    collector.register(first)  # twice: harmless
    sub = {"subscription": "sub", "topic": "orders"}
    assert value(reg, "ordering_layer_messages_acked_total", **sub) == 11
    assert value(reg, "ordering_layer_messages_acked_total", subscription="sub-2", topic="orders") == 1
    assert value(reg, "ordering_layer_partition_outstanding_messages", **sub, partition="0") == 3
    assert value(reg, "ordering_layer_partition_oldest_unacked_age_seconds", **sub, partition="0") == 3.0
    collector.unregister(first)
    assert value(reg, "ordering_layer_messages_acked_total", **sub) == 11
    assert value(reg, "ordering_layer_partition_outstanding_messages", **sub, partition="0") == 2


def test_failing_source_does_not_fail_the_scrape(registry: tuple[CollectorRegistry, LayerCollector]) -> None:
    """A source whose snapshot raises is left out of that scrape; the others are served."""
    reg, collector = registry
    broken, fine = FakeEngine("broken"), FakeEngine("fine")
    broken.fail, fine.counters["delivered"] = True, 2
    collector.register(broken)
    collector.register(fine)
    assert b"ordering_layer_messages_delivered_total" in generate_latest(reg)
    assert value(reg, "ordering_layer_messages_delivered_total", subscription="fine", topic="orders") == 2


def test_producer_paused_keys_and_sampled_publish_latency(registry: tuple[CollectorRegistry, LayerCollector]) -> None:
    """A producer's paused keys are a gauge; its latency samples a histogram per topic."""
    reg, collector = registry
    producer = FakeProducer()
    producer.paused = 2
    producer.samples = [("a", 0.002), ("a", 0.02), ("b", 1.0)]
    collector.register(producer)
    assert value(reg, "ordering_layer_paused_ordering_keys") == 2
    assert value(reg, "ordering_layer_publish_latency_seconds_count", topic="a") == 2
    assert value(reg, "ordering_layer_publish_latency_seconds_bucket", topic="a", le="0.0025") == 1
    assert value(reg, "ordering_layer_publish_latency_seconds_count", topic="b") == 1
