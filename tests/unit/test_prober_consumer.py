"""The prober's handler on fake messages: poison messages behave as their attribute says, acks are
confirmed in the event stream (DLQ-2, DLQ-3, ACK-5)."""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any, cast

import pytest

from ordering_layer.errors import ConfigError
from ordering_layer.prober.consumer import EXIT_STATUS_POISON, HandlerPlan, ProbeConsumer
from ordering_layer.prober.events import (
    ACK,
    ACK_FAILED,
    ACK_OK,
    ATTR_POISON,
    ATTR_RUN,
    ATTR_SEQ,
    NACK,
    Event,
    Settlement,
)
from ordering_layer.subscriber import AckResponse, Message


class FakeMessage:
    """What the handler uses of a ``Message``; the ack's response is given."""

    def __init__(self, attributes: dict[str, str], response: AckResponse = AckResponse.SUCCESS) -> None:
        self.attributes = attributes
        self.ordering_key = "k"
        self.message_id = "m1"
        self.delivery_attempt = 1
        self.response = response
        self.calls: list[str] = []

    def nack(self, error: str | None = None) -> None:
        self.calls.append("nack")

    def ack_with_response(self) -> Future[AckResponse]:
        self.calls.append("ack")
        future: Future[AckResponse] = Future()
        future.set_result(self.response)
        return future


def handle(attributes: dict[str, str], plan: HandlerPlan | None = None,
           response: AckResponse = AckResponse.SUCCESS) -> tuple[FakeMessage, list[Event]]:
    events: list[Event] = []
    prober = ProbeConsumer({"bootstrap.servers": "x"}, "redis://x", "sub", "topic", front_end="callback",
                           handler=plan or HandlerPlan(), sink=events.append, subscriber_id="s1")
    message = FakeMessage(attributes, response)
    prober._on_message(cast(Message, message))
    return message, events


def outcomes(events: list[Event]) -> list[str]:
    return [e.outcome for e in events if isinstance(e, Settlement)]


def test_acks_are_confirmed_or_reported_refused() -> None:
    """ACK-5: every ack's response is recorded: ack_ok for SUCCESS, ack_failed otherwise."""
    message, events = handle({ATTR_RUN: "r", ATTR_SEQ: "0"})
    assert message.calls == ["ack"] and outcomes(events) == [ACK, ACK_OK]
    _, events = handle({ATTR_RUN: "r", ATTR_SEQ: "0"}, response=AckResponse.LEASE_LOST)
    assert outcomes(events) == [ACK, ACK_FAILED]


def test_poison_nack_is_nacked_whatever_the_nack_rate() -> None:
    """DLQ-2: a 'nack' poison message is nacked on every delivery."""
    message, events = handle({ATTR_POISON: "nack"}, HandlerPlan(nack_rate=0.0))
    assert message.calls == ["nack"] and outcomes(events) == [NACK]


def test_poison_hold_is_held_then_acked() -> None:
    """ACK-2: a 'hold' poison message is held for poison_hold seconds, then acked."""
    message, events = handle({ATTR_POISON: "hold"}, HandlerPlan(poison_hold=0.05))
    assert message.calls == ["ack"] and outcomes(events) == [ACK, ACK_OK]
    with pytest.raises(ConfigError):
        HandlerPlan(poison_hold=-1)


def test_poison_exit_ends_the_process_after_recording_the_delivery(monkeypatch: pytest.MonkeyPatch) -> None:
    """DLQ-3: an 'exit' poison message ends the process (os._exit) once its delivery is recorded."""
    def fake_exit(status: int) -> Any:
        raise SystemExit(status)

    monkeypatch.setattr(os, "_exit", fake_exit)
    with pytest.raises(SystemExit) as exited:
        handle({ATTR_POISON: "exit"})
    assert exited.value.code == EXIT_STATUS_POISON
