"""``LayerCollector``: a pull-model Prometheus collector over registered engines and producers.

Nothing is counted on the message path for it: at each scrape it asks every registered subscriber
engine for ``metrics_snapshot()`` (monotonic counters, gauges, per-partition gauges and the latency
observations made since the previous call), every pusher (``ordering_layer.push``) for its requests
by status class, waiting keys and request latencies, and every producer for its paused keys and
sampled publish latencies, and turns them into metric families. Histograms are accumulated here,
since the sources hand over only what is new. Sources with the same labels (two subscribers of one
subscription in one process) are summed; the counters of an unregistered source are kept, so a
counter never goes down while the process lives.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ordering_layer.metrics import names
from ordering_layer.metrics.backlog import BacklogReader

_LOGGER = logging.getLogger(__name__)

Labels = tuple[str, ...]
_PARTITION = "partition:"  # scrape keys of per-partition gauges (the snapshot reuses the subscription-level names)


class _Histogram:
    """Cumulative bucket counts and sum of the observations handed over so far."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, values: list[float]) -> None:
        counts, bounds = self.counts, self.bounds
        for value in values:
            counts[bisect.bisect_left(bounds, value)] += 1  # le is inclusive: value == bound goes in it
        self.total += sum(values)

    def buckets(self) -> list[tuple[str, float]]:
        cumulative, out = 0, []
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            cumulative += count
            out.append((bound, float(cumulative)))
        return out


@dataclass
class _Source:
    """A registered engine, pusher or producer, and the backlog reader of its subscription (engines only)."""

    obj: Any
    labels: Labels  # (subscription, topic) for an engine or a pusher, () for a producer
    backlog: BacklogReader | None = None
    pusher: bool = False


@dataclass
class _Scrape:
    """Values of one scrape, summed over sources with the same labels."""

    counters: dict[str, dict[Labels, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    gauges: dict[str, dict[Labels, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    paused_keys: int = 0


def is_engine(obj: Any) -> bool:
    """Engines name their subscription; producers do not."""
    return hasattr(obj, "subscription")


def is_pusher(obj: Any) -> bool:
    """Pushers name their subscription and its endpoint."""
    return hasattr(obj, "push_endpoint")


class LayerCollector(Collector):
    """Collects the layer's metrics from registered sources at each scrape (see the module doc).

    Args:
        backlog_ttl: seconds a backlog reading from Kafka is reused.
    """

    def __init__(self, backlog_ttl: float = 5.0) -> None:
        self._lock = threading.Lock()
        self._sources: dict[int, _Source] = {}
        self._backlog_ttl = backlog_ttl
        self._retired: dict[str, dict[Labels, int]] = defaultdict(lambda: defaultdict(int))
        self._histograms: dict[str, dict[Labels, _Histogram]] = defaultdict(dict)

    def register(self, obj: Any, kafka_config: Mapping[str, Any] | None = None) -> None:
        """Collect from an engine (``metrics_snapshot()``, ``subscription``, ``topic``) or a producer
        (``metrics_snapshot()`` with ``paused_keys`` and ``publish_latency_seconds``). With
        ``kafka_config``, an engine's backlog is read from Kafka too. Registering twice is harmless."""
        with self._lock:
            if id(obj) in self._sources:
                return
            if is_pusher(obj):
                self._sources[id(obj)] = _Source(obj, (str(obj.subscription), str(obj.topic)), pusher=True)
            elif is_engine(obj):
                labels: Labels = (str(obj.subscription), str(obj.topic))
                reader = (BacklogReader(kafka_config, obj.subscription, obj.topic, self._backlog_ttl)
                          if kafka_config is not None else None)
                self._sources[id(obj)] = _Source(obj, labels, reader)
            else:
                self._sources[id(obj)] = _Source(obj, ())

    def unregister(self, obj: Any) -> None:
        """Stop collecting from ``obj``; its counters and latencies so far stay in the totals."""
        with self._lock:
            source = self._sources.pop(id(obj), None)
            if source is None:
                return
            scrape = _Scrape()
            self._read(source, scrape)
            for name, values in scrape.counters.items():
                for labels, value in values.items():
                    self._retired[name][labels] += value
        if source.backlog is not None:
            source.backlog.close()

    def describe(self) -> Iterator[Metric]:
        """The families without samples (lets the registry check names without a scrape)."""
        yield from self._families(_Scrape())

    def collect(self) -> Iterator[Metric]:
        """Read every source and yield the metric families."""
        with self._lock:
            scrape = _Scrape()
            for name, values in self._retired.items():
                for labels, value in values.items():
                    scrape.counters[name][labels] += value
            for source in self._sources.values():
                self._read(source, scrape)
            families = list(self._families(scrape))
        yield from families

    def _read(self, source: _Source, scrape: _Scrape) -> None:
        try:
            snapshot = source.obj.metrics_snapshot()
        except Exception:
            # A scrape must not fail because one source is closing or broken.
            _LOGGER.exception("metrics_snapshot of %r failed", source.obj)
            return
        if source.pusher:
            self._read_pusher(source.labels, snapshot, scrape)
        elif source.labels:
            self._read_engine(source, snapshot, scrape)
        else:
            self._read_producer(snapshot, scrape)

    def _read_engine(self, source: _Source, snapshot: Mapping[str, Any], scrape: _Scrape) -> None:
        labels = source.labels
        for key in names.COUNTERS:
            scrape.counters[key][labels] += int(snapshot.get(key, 0))
        for key in names.GAUGES:
            scrape.gauges[key][labels] += snapshot.get(key, 0)
        partitions: Mapping[int, Mapping[str, Any]] = snapshot.get("partitions", {})
        for partition, values in partitions.items():
            row = (*labels, str(partition))
            for key in names.PARTITION_GAUGES:
                value, gauge = values.get(key, 0), scrape.gauges[_PARTITION + key]
                if key == "oldest_unacked_seconds":
                    gauge[row] = max(gauge.get(row, 0.0), value)
                else:
                    gauge[row] += value
        if source.backlog is not None:
            for partition, backlog in source.backlog.backlog(sorted(partitions)).items():
                scrape.gauges["backlog"][(*labels, str(partition))] = backlog
        for key, (_, _, bounds) in names.ENGINE_HISTOGRAMS.items():
            self._observe(key, labels, bounds, snapshot.get(key) or [])

    def _read_pusher(self, labels: Labels, snapshot: Mapping[str, Any], scrape: _Scrape) -> None:
        for status_class, count in (snapshot.get("requests") or {}).items():
            scrape.counters["push_requests"][(*labels, status_class)] += int(count)
        for key in names.PUSH_GAUGES:
            scrape.gauges["push:" + key][labels] += snapshot.get(key, 0)
        self._observe("push_request_latency_seconds", labels, names.PUSH_LATENCY[2],
                      snapshot.get("request_latency_seconds") or [])

    def _read_producer(self, snapshot: Mapping[str, Any], scrape: _Scrape) -> None:
        scrape.paused_keys += int(snapshot.get("paused_keys", 0))
        by_topic: dict[str, list[float]] = defaultdict(list)
        for topic, seconds in snapshot.get("publish_latency_seconds") or []:
            by_topic[topic].append(seconds)
        for topic, values in by_topic.items():
            self._observe("publish_latency_seconds", (topic,), names.PUBLISH_LATENCY[2], values)

    def _observe(self, key: str, labels: Labels, bounds: tuple[float, ...], values: list[float]) -> None:
        histogram = self._histograms[key].get(labels)
        if histogram is None:
            histogram = self._histograms[key][labels] = _Histogram(bounds)
        if values:
            histogram.observe(values)

    def _families(self, scrape: _Scrape) -> Iterator[Metric]:
        prefix = names.PREFIX
        sub_labels, part_labels = list(names.SUBSCRIPTION_LABELS), list(names.PARTITION_LABELS)
        for key, (name, doc) in names.COUNTERS.items():
            counter = CounterMetricFamily(prefix + name, doc, labels=sub_labels)
            for labels, value in sorted(scrape.counters[key].items()):
                counter.add_metric(list(labels), value)
            yield counter
        gauge_specs = [(key, name, doc, sub_labels) for key, (name, doc) in names.GAUGES.items()]
        gauge_specs += [(_PARTITION + key, name, doc, part_labels)
                        for key, (name, doc) in names.PARTITION_GAUGES.items()]
        gauge_specs.append(("backlog", *names.BACKLOG, part_labels))
        gauge_specs += [("push:" + key, name, doc, sub_labels) for key, (name, doc) in names.PUSH_GAUGES.items()]
        for key, name, doc, label_names in gauge_specs:
            gauge = GaugeMetricFamily(prefix + name, doc, labels=label_names)
            for labels, reading in sorted(scrape.gauges[key].items()):
                gauge.add_metric(list(labels), reading)
            yield gauge
        yield GaugeMetricFamily(prefix + names.PAUSED_KEYS[0], names.PAUSED_KEYS[1], value=scrape.paused_keys)
        requests = CounterMetricFamily(prefix + names.PUSH_REQUESTS[0], names.PUSH_REQUESTS[1],
                                       labels=[*sub_labels, "status_class"])
        for labels, value in sorted(scrape.counters["push_requests"].items()):
            requests.add_metric(list(labels), value)
        yield requests
        histogram_specs = [(key, name, doc, sub_labels) for key, (name, doc, _) in names.ENGINE_HISTOGRAMS.items()]
        histogram_specs.append(("publish_latency_seconds", *names.PUBLISH_LATENCY[:2], ["topic"]))
        histogram_specs.append(("push_request_latency_seconds", *names.PUSH_LATENCY[:2], sub_labels))
        for key, name, doc, label_names in histogram_specs:
            family = HistogramMetricFamily(prefix + name, doc, labels=label_names)
            for labels, histogram in sorted(self._histograms[key].items()):
                family.add_metric(list(labels), histogram.buckets(), histogram.total)
            yield family
