"""Delivery spans of one subscription at one subscriber (OpenTelemetry; see ``ordering_layer.tracing``,
whose module doc describes them): each delivery to user code gets a CONSUMER span, child of the
context its record carries, that its settle ends."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from ordering_layer.record import display_key
from ordering_layer.subscriber.message import AckResponse, Message
from ordering_layer.subscriber.requests import Settle, SettleKind
from ordering_layer.tracing import (
    ACK_RESPONSE,
    BODY_SIZE,
    CONSUMER_GROUP,
    DEADLINE_SECONDS,
    DELIVERY_ATTEMPT,
    DESTINATION,
    ERROR,
    KEY,
    MESSAGE_ID,
    OFFSET,
    OPERATION,
    PARTITION,
    SYSTEM,
    carrier_of,
    otel_modules,
)

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Tracer

__all__ = ["DeliveryTracing"]


class DeliveryTracing:
    """Delivery spans of one subscription at one subscriber (see the module doc).

    A traced message's ``_submit`` (where its acks, nacks and deadline changes go) is a ``_Settling``
    that notes each on the span and passes it on; untraced messages are left as the core made them.

    Args:
        tracer: the subscriber's tracer.
        subscription: the subscription (named on every span).
    """

    def __init__(self, tracer: Tracer, subscription: str) -> None:
        otel = otel_modules()
        self.ack, self.deadline = SettleKind.ACK, SettleKind.DEADLINE
        self._tracer = tracer
        self._subscription = subscription
        self._extract = otel.propagate.extract
        self._current_span = otel.trace.get_current_span
        self._in_context = otel.trace.set_span_in_context
        self._link = otel.trace.Link
        self._kind = otel.trace.SpanKind.CONSUMER
        self._attach = otel.context.attach
        self._detach = otel.context.detach
        self.status = otel.status
        self.lock = threading.Lock()
        self.open: dict[tuple[int, int], _Settling] = {}  # (partition, offset) -> its unsettled delivery

    def deliver(self, message: Message) -> _Settling:
        """Start the delivery span of ``message``, about to reach user code, and watch its settle.
        An earlier delivery of the same record still open here ends as ``superseded``."""
        record = message.record
        parent = self._extract(carrier_of(record.headers))
        creation = self._current_span(parent).get_span_context()
        attributes: dict[str, str | int] = {
            SYSTEM: "kafka", DESTINATION: message.topic(), OPERATION: "process",
            CONSUMER_GROUP: self._subscription, PARTITION: record.partition, OFFSET: record.offset,
            MESSAGE_ID: message.message_id, BODY_SIZE: len(record.value or b""),
            DELIVERY_ATTEMPT: message.attempt}
        if record.key:
            attributes[KEY] = display_key(record.key)
        span = self._tracer.start_span(f"{message.topic()} process", context=parent, kind=self._kind,
                                       attributes=attributes,
                                       links=[self._link(creation)] if creation.is_valid else None)
        settling = _Settling(self, (record.partition, record.offset), span, self._in_context(span, parent),
                             message._submit)
        message._submit = settling
        with self.lock:
            earlier = self.open.get(settling.record)
            self.open[settling.record] = settling
        if earlier is not None:
            earlier.end("superseded")
        return settling

    def deliver_all(self, messages: Iterable[Message]) -> None:
        """Start the delivery spans of messages a pull returned."""
        for message in messages:
            self.deliver(message)

    def wrap(self, callback: Callable[[Message], Any]) -> Callable[[Message], None]:
        """``callback`` run inside each message's delivery span (current while it runs); a callback
        that raises marks the span as an error (its nack then ends it)."""

        def traced(message: Message) -> None:
            settling = self.deliver(message)
            token = self._attach(settling.context)
            try:
                callback(message)
            except Exception as exc:
                settling.failed(exc)
                raise
            finally:
                self._detach(token)

        return traced

    def close(self) -> None:
        """End the spans of deliveries still unsettled: the subscriber stopped."""
        with self.lock:
            left = list(self.open.values())
        for settling in left:
            settling.end("closed")


class _Settling:
    """Stands in for a traced message's ``_submit``: notes the request on its delivery span, then
    posts it where the message's requests go."""

    __slots__ = ("_span", "_submit", "_tracing", "context", "record")

    def __init__(self, tracing: DeliveryTracing, record: tuple[int, int], span: Span, context: Context,
                 submit: Callable[[Settle | Message | list[Message]], None]) -> None:
        self._tracing = tracing
        self.record = record
        self._span: Span | None = span
        self.context = context
        self._submit = submit

    @property
    def span(self) -> Span | None:
        """The delivery span (None once it ended)."""
        return self._span

    def __call__(self, request: Settle | Message | list[Message]) -> None:
        tracing = self._tracing
        if isinstance(request, tuple):  # a Settle (a plain ack is the Message, or a list of it)
            if request.kind == tracing.deadline:
                span = self._span
                if span is not None:
                    span.add_event("modify_ack_deadline", {DEADLINE_SECONDS: request.seconds})
            else:
                name = "ack" if request.kind == tracing.ack else "nack"
                attributes = {ERROR: request.error} if request.error else {}
                if request.future is None:
                    self.end(name, attributes)
                else:
                    span = self._span
                    if span is not None:
                        span.add_event(name, attributes)
                    request.future.add_done_callback(self._answered)
        else:  # a plain ack: the message itself, or a list of it (``ack_all``)
            self.end("ack")
        self._submit(request)

    def _answered(self, future: Future[AckResponse]) -> None:
        span = self._span
        if span is not None and future.exception() is None:
            span.set_attribute(ACK_RESPONSE, future.result().value)
        self.end(None)

    def failed(self, exc: Exception) -> None:
        """The callback raised ``exc``."""
        span = self._span
        if span is not None:
            span.record_exception(exc)
            span.set_status(self._tracing.status(repr(exc)))

    def end(self, event: str | None, attributes: Mapping[str, str] | None = None) -> None:
        """End the span after an event named ``event`` (None: none); once only, from any thread."""
        tracing = self._tracing
        with tracing.lock:
            span, self._span = self._span, None
            if tracing.open.get(self.record) is self:
                del tracing.open[self.record]
        if span is not None:
            if event is not None:
                span.add_event(event, attributes)
            span.end()
