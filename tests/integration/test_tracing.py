"""OpenTelemetry tracing against the real broker and Redis: one message followed from its publish
through a nack and its redelivery, in callback mode, pull mode and through the drop-in consumer; and
its trace context read by a plain Kafka consumer in another process (``ordering_layer.tracing``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from ordering_layer import Message, OrderedConsumer, OrderedProducer, PublishResult, Subscriber
from tests.checker import wait_until

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")  # version 00: trace id, span id, flags


def _publish(kafka_config: dict[str, Any], provider: TracerProvider, topic: str) -> PublishResult:
    """One traced publish of key customer-17 under an application span "checkout"."""
    with OrderedProducer(kafka_config, settings={"tracing": True}, tracer_provider=provider) as producer, \
            provider.get_tracer("app").start_as_current_span("checkout"):
        return producer.publish(topic, b'{"total": 17}', ordering_key="customer-17",
                                attributes={"v": "1"}).result(timeout=60)


def _named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name]


def _check_trace(exporter: InMemorySpanExporter, topic: str, subscription: str,
                 result: PublishResult) -> tuple[ReadableSpan, ReadableSpan]:
    """The spans of one message published once, nacked at its first delivery and acked at its
    second: the publish span (child of "checkout") and the two delivery spans, both children of
    the publish span and linked to it, with the record's attributes. Returns the two deliveries."""
    [checkout] = _named(exporter, "checkout")
    [publish] = _named(exporter, f"{topic} publish")
    assert publish.kind is SpanKind.PRODUCER
    assert publish.parent is not None and publish.parent.span_id == checkout.context.span_id
    assert dict(publish.attributes or {}) == {
        "messaging.system": "kafka", "messaging.destination.name": topic, "messaging.operation": "publish",
        "messaging.kafka.message.key": "customer-17", "messaging.message.body.size": 13,
        "messaging.kafka.destination.partition": result.partition, "messaging.kafka.offset": result.offset,
        "messaging.message.id": result.message_id}
    deliveries = sorted(_named(exporter, f"{topic} process"), key=lambda span: span.start_time or 0)
    assert len(deliveries) == 2
    for attempt, span in enumerate(deliveries, 1):
        assert span.kind is SpanKind.CONSUMER
        assert span.context.trace_id == publish.context.trace_id
        assert span.parent is not None and span.parent.span_id == publish.context.span_id
        assert [link.context.span_id for link in span.links] == [publish.context.span_id]
        attributes = {k: v for k, v in (span.attributes or {}).items() if k != "ordering_layer.ack_response"}
        assert attributes == {
            "messaging.system": "kafka", "messaging.destination.name": topic, "messaging.operation": "process",
            "messaging.kafka.consumer.group": subscription, "messaging.kafka.message.key": "customer-17",
            "messaging.kafka.destination.partition": result.partition, "messaging.kafka.offset": result.offset,
            "messaging.message.id": result.message_id, "messaging.message.body.size": 13,
            "ordering_layer.delivery_attempt": attempt}
    nacked, acked = deliveries
    assert [event.name for event in nacked.events] == ["nack"]
    assert (nacked.events[0].attributes or {}) == {"ordering_layer.error": "not yet"}
    assert [event.name for event in acked.events] == ["ack"]
    assert nacked.end_time is not None and acked.start_time is not None and nacked.end_time <= acked.start_time
    return nacked, acked


def test_callback_mode_follows_a_message_through_a_nack_and_its_redelivery(
        kafka_config: dict[str, Any], endpoints: Any, subscription: Callable[..., tuple[str, str]],
        provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """Publish (PRODUCER span, context in ``traceparent``) -> delivery 1, nacked -> delivery 2, acked:
    two CONSUMER spans under the publish span; each callback runs in its delivery's span."""
    topic, name = subscription(partitions=3)
    result = _publish(kafka_config, provider, topic)
    seen: list[tuple[int, int, dict[str, str], list[str]]] = []
    done = threading.Event()

    def callback(message: Message) -> None:
        with provider.get_tracer("app").start_as_current_span("handle") as handle:
            parent = handle.parent  # type: ignore[attr-defined]  # the SDK's span
            seen.append((message.delivery_attempt, parent.span_id, message.attributes,
                         [name for name, _ in message.headers() or []]))
        if message.delivery_attempt == 1:
            message.nack(error="not yet")
        else:
            message.ack()
            done.set()

    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url, tracer_provider=provider)
    with subscriber.subscribe(name, callback, max_workers=2):
        assert done.wait(60), "the redelivery was not acked"
    nacked, acked = _check_trace(exporter, topic, name, result)
    assert [(attempt, span_id) for attempt, span_id, _, _ in seen] == [
        (1, nacked.context.span_id), (2, acked.context.span_id)]
    # The trace headers stay in the attributes (headers outside ol- with UTF-8 values) and in headers().
    attributes, names = seen[0][2], seen[0][3]
    assert attributes["v"] == "1" and TRACEPARENT.match(attributes["traceparent"])
    assert names == ["ol-partition-count", "v", "traceparent"]


def test_pull_mode_and_the_drop_in_consumer_trace_each_delivery_until_its_settle(
        kafka_config: dict[str, Any], endpoints: Any, subscription: Callable[..., tuple[str, str]],
        provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """The same trace when the message is pulled (nack, then ack) and when the drop-in consumer
    returns it (nack, then its commit acks it)."""
    topic, name = subscription(partitions=1)
    result = _publish(kafka_config, provider, topic)
    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url, tracer_provider=provider)
    try:
        batches: list[list[Message]] = []

        def pulled(attempt: int) -> bool:
            batch = subscriber.pull(name, max_messages=10, timeout=0.5)
            batches.append(batch)
            return any(m.delivery_attempt == attempt for m in batch)

        wait_until(lambda: pulled(1), 60, "the first delivery")
        batches[-1][0].nack(error="not yet")
        wait_until(lambda: pulled(2), 60, "the redelivery")
        batches[-1][0].ack()
    finally:
        subscriber.close()
    _check_trace(exporter, topic, name, result)

    exporter.clear()
    topic, name = subscription(partitions=1)
    result = _publish(kafka_config, provider, topic)
    consumer = OrderedConsumer({**kafka_config, "group.id": name, "enable.auto.commit": False},
                               redis_url=endpoints.redis_url, tracer_provider=provider)
    try:
        consumer.subscribe([topic])
        first = consumer.poll(60)
        assert first is not None and first.delivery_attempt == 1
        first.nack(error="not yet")
        second = consumer.poll(60)
        assert second is not None and second.delivery_attempt == 2
        consumer.commit(second, asynchronous=False)
    finally:
        consumer.close()
    _, acked = _check_trace(exporter, topic, name, result)
    assert (acked.attributes or {})["ordering_layer.ack_response"] == "SUCCESS"  # a synchronous commit's answer


_READER = """if True:
    import json, sys
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    from tests.kafka_helpers import read_topic

    [record] = read_topic(json.loads(sys.argv[1]), sys.argv[2], 1)
    headers = {name: value.decode() for name, value in record.headers() or []}
    parent = trace.get_current_span(TraceContextTextMapPropagator().extract(headers)).get_span_context()
    print(json.dumps({"traceparent": headers.get("traceparent"), "trace_id": parent.trace_id,
                      "span_id": parent.span_id, "valid": parent.is_valid}))
"""


def test_a_plain_kafka_consumer_in_another_process_reads_the_publish_context(
        kafka_config: dict[str, Any], topic_factory: Callable[..., str], provider: TracerProvider,
        exporter: InMemorySpanExporter) -> None:
    """The record carries the W3C ``traceparent`` header that other OpenTelemetry Kafka instrumentations
    read: a plain confluent-kafka consumer in another process extracts the publish span's context."""
    topic = topic_factory(partitions=1)
    _publish(kafka_config, provider, topic)
    [publish] = _named(exporter, f"{topic} publish")
    out = subprocess.run([sys.executable, "-c", _READER, json.dumps(kafka_config), topic], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    read = json.loads(out.stdout.strip().splitlines()[-1])
    match = TRACEPARENT.match(read["traceparent"] or "")
    assert match, read
    assert (int(match[1], 16), int(match[2], 16)) == (publish.context.trace_id, publish.context.span_id)
    assert read["valid"] and (read["trace_id"], read["span_id"]) == (publish.context.trace_id,
                                                                     publish.context.span_id)
    assert trace.format_trace_id(publish.context.trace_id) == match[1]
