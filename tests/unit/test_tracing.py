"""OpenTelemetry tracing without a broker: the switch, the trace headers a publish adds, the delivery
spans and their settles (``ordering_layer.tracing``)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest
from confluent_kafka import KafkaError
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ordering_layer import OrderedProducer, PublisherSettings
from ordering_layer import tracing as tracing_module
from ordering_layer.errors import ConfigError
from ordering_layer.publisher import producer as producer_module
from ordering_layer.record import HEADER_PARTITION_COUNT, RecordMetadata
from ordering_layer.subscriber.delivery_tracing import DeliveryTracing
from ordering_layer.subscriber.message import AckResponse, Message
from ordering_layer.subscriber.records import Record
from ordering_layer.subscriber.requests import Settle, SettleKind
from ordering_layer.tracing import TRACING_ENV, span_of, tracer
from tests.unit.test_publish_path import FakeMessage

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def no_environment_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TRACING_ENV, raising=False)


def _producer(**kwargs: Any) -> tuple[OrderedProducer, list[tuple[Any, ...]]]:
    """A producer whose produce() records its arguments, with topic "t" cached at 6 partitions."""
    producer = OrderedProducer({"bootstrap.servers": "127.0.0.1:9", "log_level": 0}, **kwargs)
    calls: list[tuple[Any, ...]] = []
    producer._produce = lambda *args, **kw: calls.append(args)
    producer._topics["t"] = producer_module._Topic(6, float("inf"), (HEADER_PARTITION_COUNT, b"6"), 100)
    return producer, calls


@pytest.fixture
def traced(provider: TracerProvider) -> Iterator[tuple[OrderedProducer, list[tuple[Any, ...]]]]:
    producer, calls = _producer(settings={"tracing": True}, tracer_provider=provider)
    yield producer, calls
    producer._closed = True
    producer._poller.stop()


def _headers(call: tuple[Any, ...]) -> dict[str, Any]:
    return dict(call[7])  # positional: topic, value, key, partition, callback, on_delivery, timestamp, headers


def _parent_of(headers: dict[str, Any]) -> trace.SpanContext:
    carrier = {name: value.decode() for name, value in headers.items() if isinstance(value, bytes)}
    return trace.get_current_span(TraceContextTextMapPropagator().extract(carrier)).get_span_context()


# -- the switch ------------------------------------------------------------------------------------


def test_tracing_is_off_by_default_and_adds_nothing() -> None:
    """Off unless asked for: no tracer, no trace headers, and the producer's send path untouched."""
    assert tracer(None) is None
    assert PublisherSettings().tracing is None
    producer, calls = _producer()
    try:
        assert producer._tracing is None
        producer.publish("t", b"x", ordering_key="k", attributes={"v": "1"})
        assert [name for name, _ in calls[0][7]] == [HEADER_PARTITION_COUNT, "v"]
    finally:
        producer.close(0)


def test_the_switch_is_read_once_from_settings_provider_or_environment(monkeypatch: pytest.MonkeyPatch,
                                                                       provider: TracerProvider) -> None:
    assert tracer(True) is not None
    assert tracer(None, provider) is not None  # a provider asks for tracing
    assert tracer(False, provider) is None  # an explicit False wins
    monkeypatch.setenv(TRACING_ENV, "1")
    assert tracer(None) is not None
    assert tracer(False) is None
    monkeypatch.setenv(TRACING_ENV, "0")
    assert tracer(None) is None


def test_without_opentelemetry_asking_in_code_is_refused_and_the_environment_only_warns(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    tracing_module.otel_modules.cache_clear()
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # import opentelemetry -> ImportError
    try:
        with pytest.raises(ConfigError, match="opentelemetry-api") as refused:
            tracer(True)
        assert refused.value.setting == "tracing"
        monkeypatch.setenv(TRACING_ENV, "1")
        with caplog.at_level(logging.WARNING, logger="ordering_layer.tracing"):
            assert tracer(None) is None
        assert "opentelemetry-api is not installed" in caplog.text
    finally:
        monkeypatch.undo()
        tracing_module.otel_modules.cache_clear()


def test_the_package_imports_and_publishes_untraced_without_opentelemetry() -> None:
    """No hard dependency: with opentelemetry unimportable the package imports and a producer works;
    with it installed, tracing off does not load it (redis-py may import parts of it on its own)."""
    program = """if True:
        import sys
        block = sys.argv[1] == "block"
        if block:
            sys.modules["opentelemetry"] = None
        import ordering_layer
        from ordering_layer import OrderedProducer, Subscriber, OrderedConsumer, tracing
        producer = OrderedProducer({"bootstrap.servers": "127.0.0.1:9", "log_level": 0})
        assert producer._tracing is None
        producer.close(0)
        assert tracing.tracer(None) is None
        assert tracing.otel_modules.cache_info().currsize == 0, "the layer looked for opentelemetry"
        print("ok")
    """
    for mode in ("block", "installed"):
        result = subprocess.run([sys.executable, "-c", program, mode], cwd=ROOT, capture_output=True, text=True,
                                timeout=120, env={k: v for k, v in os.environ.items() if k != TRACING_ENV})
        assert result.returncode == 0 and result.stdout.strip() == "ok", (mode, result.stderr)


# -- publish ---------------------------------------------------------------------------------------


def test_publish_injects_w3c_trace_context_and_the_report_ends_the_span(
        traced: tuple[OrderedProducer, list[tuple[Any, ...]]], exporter: InMemorySpanExporter,
        provider: TracerProvider) -> None:
    """A PRODUCER span "<topic> publish", child of the caller's span; its context in ``traceparent``;
    ended by the delivery report with partition, offset and message id."""
    producer, calls = traced
    with provider.get_tracer("app").start_as_current_span("request") as request:
        future = producer.publish("t", b"payload", ordering_key="customer-17", attributes={"v": "1"})
    headers = _headers(calls[0])
    assert headers[HEADER_PARTITION_COUNT] == b"6" and headers["v"] == b"1"
    assert isinstance(headers["traceparent"], bytes)
    assert [span.name for span in exporter.get_finished_spans()] == ["request"]  # publish still open
    future(None, FakeMessage("t", b"customer-17", partition=2, offset=41))  # type: ignore[operator]
    [publish] = [span for span in exporter.get_finished_spans() if span.name == "t publish"]
    assert publish.kind is SpanKind.PRODUCER
    assert publish.parent is not None and publish.parent.span_id == request.get_span_context().span_id
    carried = _parent_of(headers)
    assert (carried.trace_id, carried.span_id) == (publish.context.trace_id, publish.context.span_id)
    assert dict(publish.attributes or {}) == {
        "messaging.system": "kafka", "messaging.destination.name": "t", "messaging.operation": "publish",
        "messaging.kafka.message.key": "customer-17", "messaging.message.body.size": 7,
        "messaging.kafka.destination.partition": 2, "messaging.kafka.offset": 41,
        "messaging.message.id": str((2 << 48) | 41)}
    assert future.result(0).offset == 41


def test_produce_replaces_a_callers_trace_header_and_calls_its_callback_after(
        traced: tuple[OrderedProducer, list[tuple[Any, ...]]], exporter: InMemorySpanExporter) -> None:
    """The drop-in's headers pass through, a stale ``traceparent`` among them is replaced by the
    publish span's; the caller's delivery callback runs once the span ended."""
    producer, calls = traced
    stale = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    reports: list[int] = []
    producer.produce("t", "v", "k", headers=[("traceparent", stale), ("a", None), ("b", b"\xff")],
                     callback=lambda err, msg: reports.append(len(exporter.get_finished_spans())))
    pairs = calls[0][7]
    assert [name for name, _ in pairs].count("traceparent") == 1
    assert ("a", None) in pairs and ("b", b"\xff") in pairs
    assert dict(pairs)["traceparent"] != stale
    calls[0][4](None, FakeMessage("t", b"k", partition=1, offset=0))
    assert reports == [1]


def test_a_failed_or_refused_publish_ends_its_span_as_an_error(
        traced: tuple[OrderedProducer, list[tuple[Any, ...]]], exporter: InMemorySpanExporter) -> None:
    producer, _ = traced
    future = producer.publish("t", b"x", ordering_key="k", message_id="m-1")
    future(KafkaError(KafkaError._MSG_TIMED_OUT), FakeMessage("t", b"k"))  # type: ignore[operator]
    with pytest.raises(Exception, match="ordering key"):
        producer.publish("t", b"x", ordering_key="k" * 2000)
    failed, refused = exporter.get_finished_spans()
    assert failed.status.status_code is StatusCode.ERROR
    assert (failed.attributes or {})["messaging.message.id"] == "m-1"
    assert refused.status.status_code is StatusCode.ERROR and refused.events[0].name == "exception"


# -- delivery --------------------------------------------------------------------------------------


def _message(headers: list[tuple[str, Any]] | None, posted: list[Any], offset: int = 7, attempt: int = 1) -> Message:
    record = Record(3, offset, b"customer-17", b"data", headers, RecordMetadata(None, 6, None), 4, 0)
    return Message(record, b"customer-17", token=offset, attempt=attempt, topic="orders", epoch=1,
                   submit=posted.append)


def _published_headers(provider: TracerProvider) -> tuple[list[tuple[str, Any]], trace.SpanContext]:
    producer, calls = _producer(settings={"tracing": True}, tracer_provider=provider)
    try:
        producer.publish("t", b"data", ordering_key="customer-17")
        headers = calls[0][7]
        return headers, _parent_of(dict(headers))
    finally:
        producer.close(0)


def _spans(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name]


def test_a_delivery_span_is_a_child_of_the_publish_context_and_an_ack_ends_it(
        provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    headers, publish = _published_headers(provider)
    posted: list[Any] = []
    message = _message(headers, posted)
    deliveries = DeliveryTracing(provider.get_tracer("t"), "billing")
    deliveries.deliver(message)
    assert span_of(message) is not None
    message.ack()
    assert posted == [message]  # the plain ack still posts the message itself
    assert span_of(message) is None
    [span] = _spans(exporter, "orders process")
    assert span.kind is SpanKind.CONSUMER
    assert span.parent is not None and (span.parent.trace_id, span.parent.span_id) == (publish.trace_id,
                                                                                        publish.span_id)
    assert [(link.context.trace_id, link.context.span_id) for link in span.links] == [(publish.trace_id,
                                                                                       publish.span_id)]
    assert dict(span.attributes or {}) == {
        "messaging.system": "kafka", "messaging.destination.name": "orders", "messaging.operation": "process",
        "messaging.kafka.consumer.group": "billing", "messaging.kafka.destination.partition": 3,
        "messaging.kafka.offset": 7, "messaging.message.id": str((3 << 48) | 7), "messaging.message.body.size": 4,
        "ordering_layer.delivery_attempt": 1, "messaging.kafka.message.key": "customer-17"}
    assert [event.name for event in span.events] == ["ack"]
    assert deliveries.open == {}


def test_a_raising_callback_is_an_error_and_its_nack_ends_the_span(provider: TracerProvider,
                                                                  exporter: InMemorySpanExporter) -> None:
    headers, _ = _published_headers(provider)
    posted: list[Any] = []
    message = _message(headers, posted)
    seen: list[trace.Span] = []

    def callback(m: Message) -> None:
        seen.append(trace.get_current_span())
        m.modify_ack_deadline(30)
        raise ValueError("boom")

    handler = DeliveryTracing(provider.get_tracer("t"), "billing").wrap(callback)
    with pytest.raises(ValueError):
        handler(message)
    assert trace.get_current_span() is trace.INVALID_SPAN  # the context is detached after the callback
    message.nack(error="ValueError('boom')")  # what the subscriber's worker does next
    [span] = _spans(exporter, "orders process")
    assert seen[0].get_span_context().span_id == span.context.span_id  # current during the callback
    assert [event.name for event in span.events] == ["modify_ack_deadline", "exception", "nack"]
    assert (span.events[0].attributes or {})["ordering_layer.ack_deadline_seconds"] == 30.0
    assert (span.events[2].attributes or {})["ordering_layer.error"] == "ValueError('boom')"
    assert span.status.status_code is StatusCode.ERROR
    assert [type(request) for request in posted] == [Settle, Settle]
    assert [request.kind for request in posted] == [SettleKind.DEADLINE, SettleKind.NACK]


def test_a_redelivery_supersedes_an_unsettled_delivery_and_close_ends_the_rest(
        provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """A lapsed delivery's span ends when the record is delivered again; both deliveries are
    children of the same publish context; a late ack of the first changes no span."""
    headers, publish = _published_headers(provider)
    deliveries = DeliveryTracing(provider.get_tracer("t"), "billing")
    posted: list[Any] = []
    first, second, other = _message(headers, posted), _message(headers, posted, attempt=2), _message(None, posted, 8)
    deliveries.deliver_all([first, other])
    deliveries.deliver(second)
    first.ack()  # refused by the engine later (stale token); its span ended already
    assert posted == [first]
    second.ack()
    deliveries.close()
    spans = _spans(exporter, "orders process")
    assert [[event.name for event in span.events] for span in spans] == [["superseded"], ["ack"], ["closed"]]
    assert [(span.attributes or {})["ordering_layer.delivery_attempt"] for span in spans] == [1, 2, 1]
    assert [(span.attributes or {})["messaging.kafka.offset"] for span in spans] == [7, 7, 8]
    assert [(span.parent.trace_id, span.parent.span_id) for span in spans[:2] if span.parent is not None] == [
        (publish.trace_id, publish.span_id)] * 2
    assert spans[2].parent is None and list(spans[2].links) == []  # a record without trace headers: a root
    assert deliveries.open == {}


def test_ack_with_response_ends_the_span_with_the_answer(provider: TracerProvider,
                                                        exporter: InMemorySpanExporter) -> None:
    posted: list[Any] = []
    message = _message(None, posted)
    DeliveryTracing(provider.get_tracer("t"), "billing").deliver(message)
    answer = message.ack_with_response()
    assert _spans(exporter, "orders process") == []
    request = posted[0]
    assert isinstance(request.future, Future) and request.kind == SettleKind.ACK
    request.future.set_result(AckResponse.LEASE_LOST)
    assert answer.result(0) is AckResponse.LEASE_LOST
    [span] = _spans(exporter, "orders process")
    assert [event.name for event in span.events] == ["ack"]
    assert (span.attributes or {})["ordering_layer.ack_response"] == "LEASE_LOST"
