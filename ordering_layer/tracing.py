"""OpenTelemetry tracing of publishes and deliveries: opt-in, through ``opentelemetry-api`` alone.

**Switching it on.** Tracing is decided once, when a producer or subscriber is made:
``PublisherSettings(tracing=True)``, ``Subscriber(..., tracing=True)``, ``OrderedConsumer(...,
tracing=True)``, or, for every one of them in a process (a drop-in program included, whose code
stays as it was written for confluent-kafka), ``ORDERING_LAYER_TRACING=1`` in the environment.
``tracing=False`` keeps it off whatever the environment says; ``tracer_provider=`` chooses the
provider (default: the global one, which the application's SDK set up) and switches tracing on by
itself. The layer depends on the API only: without an SDK the spans are the API's no-op ones and
only a context the caller already holds is passed on. With tracing off nothing is added per
message: the producer sends without looking at spans or headers, the subscriber hands out messages
and callbacks as they are, and ``opentelemetry`` is not even imported. The check a producer
or subscriber makes per publish or per pull is one attribute compared with None.

**Publish.** ``OrderedProducer.publish`` and ``produce`` make a PRODUCER span ``"<topic> publish"``,
child of the caller's current span, and end it at the record's delivery report, with the partition,
offset and message id (an error status when the record finally failed). Its context goes into the
record's headers through the global propagator: by default W3C ``traceparent``, ``tracestate``
when the context has one, and ``baggage`` when it has baggage, the header names other languages'
OpenTelemetry Kafka instrumentations read. A header of one of those names given to ``publish`` or
``produce`` is replaced, so that the record carries the context of its own publish.

**Delivery.** Each delivery to user code (a callback run, a message returned by ``Subscriber.pull`` or
by ``OrderedConsumer.poll``/``consume``) gets a CONSUMER span ``"<topic> process"``, child of the
context extracted from the record's headers and linked to it, so that every delivery of a message
(a nack and its redelivery included) hangs under its publish span, across processes. The span holds
the key, partition, offset, message id, delivery attempt and subscription, is current while a
callback runs (the callback's own spans are its children, the publisher's baggage is there), and is
found with ``span_of(message)`` in pull mode. The settle is an event on it: ``ack`` and ``nack``
(with the error) end it (with ``ack_with_response`` once the answer came, named in
``ordering_layer.ack_response``), ``modify_ack_deadline`` does not; a callback that raised marks
it as an error. A delivery that is not settled ends with a ``superseded`` event when the same
record is delivered again by the same subscriber (its lease lapsed, or a nack of an earlier message
of its key took it back), or with ``closed`` when the subscriber stops. A message dead-lettered
when its attempts ran out never reaches user code, so it has no delivery span.

**Attributes.** The trace headers are record headers like any other: ``Message.headers()`` returns
them byte for byte and ``Message.attributes`` (the headers outside ``ol-`` with UTF-8 values, PUB-6)
keeps them, as it keeps those of other producers' instrumentations and as Pub/Sub's client keeps
its trace attribute. Republishing ``message.attributes`` with tracing on gives the new record the
new publish's context (the old one is replaced, see above).

Attribute names follow the OpenTelemetry messaging conventions for Kafka (``messaging.system`` is
``kafka``); the delivery attempt is ``ordering_layer.delivery_attempt``.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from importlib import metadata
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

from ordering_layer.errors import ConfigError
from ordering_layer.record import HeaderPairs, HeaderValue, display_key

if TYPE_CHECKING:
    from types import ModuleType

    from confluent_kafka import KafkaError
    from confluent_kafka import Message as KafkaMessage
    from opentelemetry.trace import Span, Tracer, TracerProvider


__all__ = ["TRACING_ENV", "PublishTracing", "span_of", "tracer"]

_LOGGER = logging.getLogger(__name__)

TRACING_ENV = "ORDERING_LAYER_TRACING"
_ON = frozenset({"1", "true", "yes", "on"})
INSTRUMENTATION = "ordering_layer"

SYSTEM = "messaging.system"
DESTINATION = "messaging.destination.name"
OPERATION = "messaging.operation"
CONSUMER_GROUP = "messaging.kafka.consumer.group"
KEY = "messaging.kafka.message.key"
PARTITION = "messaging.kafka.destination.partition"
OFFSET = "messaging.kafka.offset"
MESSAGE_ID = "messaging.message.id"
BODY_SIZE = "messaging.message.body.size"
DELIVERY_ATTEMPT = "ordering_layer.delivery_attempt"
ACK_RESPONSE = "ordering_layer.ack_response"
ERROR = "ordering_layer.error"
DEADLINE_SECONDS = "ordering_layer.ack_deadline_seconds"

_F = TypeVar("_F")
DeliveryCallback = Callable[["KafkaError | None", "KafkaMessage"], None]


def tracer(enabled: bool | None, tracer_provider: TracerProvider | None = None) -> Tracer | None:
    """The tracer of a producer or subscriber being made, or None when tracing is off.

    Args:
        enabled: True or False decides; None: on when ``tracer_provider`` is given or
            ``$ORDERING_LAYER_TRACING`` is ``1``/``true``/``yes``/``on``.
        tracer_provider: the provider of the tracer; None: the global one.

    Raises:
        ConfigError: tracing was asked for in code (``enabled=True`` or a provider) and
            ``opentelemetry-api`` is not installed. Asked for by the environment alone, it stays
            off with a warning instead: a process-wide switch must not stop a program that cannot
            trace.
    """
    from_environment = False
    if enabled is None:
        if tracer_provider is None:
            if os.environ.get(TRACING_ENV, "").strip().lower() not in _ON:
                return None
            from_environment = True
    elif not enabled:
        return None
    try:
        otel = otel_modules()
    except ImportError:
        if from_environment:
            _LOGGER.warning("%s is set but opentelemetry-api is not installed: tracing stays off "
                            "(pip install 'ordering-layer[tracing]')", TRACING_ENV)
            return None
        raise ConfigError("tracing needs opentelemetry-api: pip install 'ordering-layer[tracing]'",
                          setting="tracing") from None
    chosen: Tracer = otel.trace.get_tracer(INSTRUMENTATION, _version(), tracer_provider=tracer_provider)
    return chosen


class OtelModules(NamedTuple):
    """The parts of ``opentelemetry-api`` the layer uses, imported on first use (tracing on)."""

    trace: ModuleType
    context: ModuleType
    propagate: ModuleType
    status: Callable[[str], Any]  # description -> an ERROR Status


@functools.cache
def otel_modules() -> OtelModules:
    # opentelemetry-api: the optional tracing extra, imported once tracing is switched on.
    from opentelemetry import context, propagate, trace
    from opentelemetry.trace import Status, StatusCode

    return OtelModules(trace, context, propagate, lambda description: Status(StatusCode.ERROR, description))


def _version() -> str | None:
    try:
        return metadata.version("ordering-layer")
    except metadata.PackageNotFoundError:
        return None


def carrier_of(headers: HeaderPairs | None) -> dict[str, str]:
    """The record's headers with text values, as the propagator reads them (the last of a name wins,
    as Kafka clients' ``lastHeader``)."""
    carrier: dict[str, str] = {}
    for name, value in headers or ():
        if isinstance(value, bytes):
            try:
                carrier[name] = value.decode()
            except UnicodeDecodeError:
                continue
        elif isinstance(value, str):
            carrier[name] = value
    return carrier


class PublishTracing:
    """Publish spans of one producer, and the trace headers of its records (see the module doc)."""

    def __init__(self, tracer: Tracer) -> None:
        otel = otel_modules()
        self._tracer = tracer
        self._inject = otel.propagate.inject
        self._in_context = otel.trace.set_span_in_context
        self._kind = otel.trace.SpanKind.PRODUCER
        self._status = otel.status

    def send(self, send: Callable[..., _F], topic: str, data: Any, ordering_key: str | bytes | None,
             headers: list[tuple[str, HeaderValue]] | None, message_id: str | None,
             on_delivery: DeliveryCallback | None, partition: int, timestamp: int) -> _F:
        """Call ``send`` (``OrderedProducer._send``, same arguments) inside a publish span: the span's
        context is added to ``headers``, and the delivery report ends the span before it reaches
        ``on_delivery``. A send that raises ends the span with the error."""
        attributes: dict[str, str | int] = {SYSTEM: "kafka", DESTINATION: topic, OPERATION: "publish"}
        if isinstance(ordering_key, str | bytes) and ordering_key:
            attributes[KEY] = ordering_key if isinstance(ordering_key, str) else display_key(ordering_key)
        if message_id is not None:
            attributes[MESSAGE_ID] = message_id
        if isinstance(data, bytes):
            attributes[BODY_SIZE] = len(data)
        span = self._tracer.start_span(f"{topic} publish", kind=self._kind, attributes=attributes)
        carrier: dict[str, str] = {}
        self._inject(carrier, context=self._in_context(span))
        traced = [pair for pair in headers or () if pair[0] not in carrier]
        traced.extend((name, value.encode()) for name, value in carrier.items())
        try:
            return send(topic, data, ordering_key, traced or None, message_id,
                        _Published(span, message_id, on_delivery, self._status), partition, timestamp)
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(self._status(repr(exc)))
            span.end()
            raise


class _Published:
    """A traced record's delivery callback: ends its publish span, then calls the caller's callback."""

    __slots__ = ("_message_id", "_span", "_status", "_then")

    def __init__(self, span: Span, message_id: str | None, then: DeliveryCallback | None,
                 status: Callable[[str], Any]) -> None:
        self._span = span
        self._message_id = message_id
        self._then = then
        self._status = status

    def __call__(self, err: KafkaError | None, msg: KafkaMessage) -> None:
        span = self._span
        if err is None:
            partition, offset = msg.partition() or 0, msg.offset() or 0
            span.set_attributes({PARTITION: partition, OFFSET: offset,
                                 MESSAGE_ID: self._message_id or str((partition << 48) | offset)})
        else:
            span.set_status(self._status(err.str()))
        span.end()
        if self._then is not None:
            self._then(err, msg)


class _Delivered(Protocol):
    """A subscriber's ``Message``: its requests go to ``_submit`` (its delivery tracing, if traced)."""

    _submit: Any


def span_of(message: _Delivered) -> Span | None:
    """The delivery span of ``message`` while it is open (pull mode: to make the processing's spans
    its children with ``trace.use_span(span, end_on_exit=False)``); None when the message is not
    traced or its span ended. A traced message's requests go through its delivery tracing
    (``subscriber.delivery_tracing``), which holds the span."""
    span: Span | None = getattr(message._submit, "span", None)
    return span
