"""Push subscriptions without servers: PushConfig, the request body, auth, the endpoint gate, the
acks of a loop pass, the durable record, describe's text and the metrics (PSH-1..3)."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from ordering_layer.config import PushConfig, SubscriptionSettings
from ordering_layer.describe import SubscriptionDescription
from ordering_layer.describe_table import render_description
from ordering_layer.errors import ConfigError
from ordering_layer.metrics.collector import LayerCollector
from ordering_layer.push.acks import PassAcks
from ordering_layer.push.auth import Authorizer
from ordering_layer.push.gate import EndpointGate
from ordering_layer.push.pusher import status_class
from ordering_layer.push.request import ACK_STATUSES, build, publish_time
from ordering_layer.record import encode
from ordering_layer.state.durable import decode_settings, encode_settings

URL = "https://hooks.example.internal/orders?token=query-secret"
TOKEN = "static-token-123"


def _pem(key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


RSA_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)


@dataclass
class FakeMessage:
    data: bytes = b"\x00payload\xff"
    attributes: dict[str, str] = field(default_factory=lambda: {"v": "1"})
    message_id: str = "281474976710661"
    enqueued_time: datetime = datetime(2026, 3, 4, 5, 6, 7, 891000, tzinfo=UTC)
    ordering_key: str = "customer-17"
    delivery_attempt: int = 3


def test_ack_statuses_are_pub_subs() -> None:
    """PSH-1: 102, 200, 201, 202 and 204 ack; nothing else does."""
    assert frozenset({102, 200, 201, 202, 204}) == ACK_STATUSES
    assert [status_class(s) for s in (102, 204, 302, 404, 503)] == ["1xx", "2xx", "3xx", "4xx", "5xx"]
    assert status_class(None, timed_out=True) == "timeout" and status_class(None) == "error"


def test_the_wrapped_body_is_pub_subs_push_request() -> None:
    """PSH-1: message.data base64, attributes, messageId, publishTime, orderingKey, deliveryAttempt,
    subscription."""
    body, headers = build(FakeMessage(), "orders-hook", no_wrapper=False)
    assert headers == {"Content-Type": "application/json"}
    assert json.loads(body) == {
        "message": {"data": base64.b64encode(b"\x00payload\xff").decode(), "attributes": {"v": "1"},
                    "messageId": "281474976710661", "message_id": "281474976710661",
                    "publishTime": "2026-03-04T05:06:07.891Z", "publish_time": "2026-03-04T05:06:07.891Z",
                    "orderingKey": "customer-17"},
        "subscription": "orders-hook", "deliveryAttempt": 3}


def test_the_wrapped_body_is_the_json_of_its_fields_byte_for_byte() -> None:
    """The body written piece by piece is what ``json.dumps`` makes of the same fields, quotes,
    control characters and non-ASCII text escaped alike."""
    message = FakeMessage(attributes={"a": "\u2603", 'q"': "\n"}, ordering_key='k"\u00e9\t', message_id='id"\\x')
    fields = {"data": base64.b64encode(message.data).decode(), "messageId": message.message_id,
              "message_id": message.message_id, "attributes": message.attributes,
              "publishTime": "2026-03-04T05:06:07.891Z", "publish_time": "2026-03-04T05:06:07.891Z",
              "orderingKey": message.ordering_key}
    expected = json.dumps({"message": fields, "subscription": 's"\u00fc', "deliveryAttempt": 3}, separators=(",", ":"))
    assert build(message, 's"\u00fc', no_wrapper=False).body == expected.encode()


def test_an_unordered_message_without_attributes_has_neither_field() -> None:
    """As Pub/Sub: no ``orderingKey`` without a key, no ``attributes`` without attributes."""
    message = json.loads(build(FakeMessage(attributes={}, ordering_key=""), "s", no_wrapper=False).body)["message"]
    assert "orderingKey" not in message and "attributes" not in message


def test_no_wrapper_sends_the_payload_and_the_attributes_that_can_be_headers() -> None:
    """PSH-1: raw payload; attributes as headers, except names the request sets itself and values
    that cannot be header values."""
    message = FakeMessage(attributes={"x-v": "1", "Authorization": "forged", "content-type": "x",
                                      "bad name": "1", "nl": "a\r\nInjected: 1", "ok": "fine"})
    body, headers = build(message, "s", no_wrapper=True)
    assert body == b"\x00payload\xff"
    assert headers == {"Content-Type": "application/octet-stream", "x-v": "1", "ok": "fine"}


def test_publish_time_is_utc_with_milliseconds() -> None:
    assert publish_time(datetime(2026, 1, 2, 3, 4, 5, 6000, tzinfo=UTC)) == "2026-01-02T03:04:05.006Z"


@pytest.mark.parametrize("settings", [
    {"endpoint": "ftp://x/y"}, {"endpoint": "http:///no-host"}, {"endpoint": URL, "request_timeout": 0},
    {"endpoint": URL, "max_concurrent_requests": 0}, {"endpoint": URL, "bearer_token": "a", "jwt_private_key": "b"},
    {"endpoint": URL, "bearer_token": "two\nlines"}, {"endpoint": URL, "jwt_private_key": "not a key"},
    {"endpoint": URL, "jwt_algorithm": "HS256"}, {"endpoint": URL, "jwt_lifetime": 86400},
    {"endpoint": URL, "ca_bundle": "no certificate"},
])
def test_bad_push_settings_are_refused(settings: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        PushConfig(**settings)  # type: ignore[arg-type]


def test_secrets_stay_out_of_repr_and_public_output() -> None:
    """PSH-3: neither the token, the key, nor the endpoint's query shows in a repr, ``public()`` or
    describe's text."""
    token = PushConfig(URL, bearer_token=TOKEN)
    signed = PushConfig(URL, jwt_private_key=_pem(RSA_KEY), jwt_key_id="k1")
    key_line = _pem(RSA_KEY).splitlines()[1]
    assert token.display_endpoint == "https://hooks.example.internal/orders?..."
    for config in (token, signed):
        settings = SubscriptionSettings(topic="orders", push_config=config)
        described = SubscriptionDescription("hook", settings, "Stable", (), ())
        for text in (repr(config), repr(settings), json.dumps(settings.public()), json.dumps(described.to_json()),
                     render_description(described)):
            assert TOKEN not in text and key_line not in text and "query-secret" not in text
    assert token.public()["bearer_token"] == "<set>" and signed.public()["jwt_private_key"] == "<set>"
    assert "push https://hooks.example.internal/orders?...  JSON wrapper" in render_description(
        SubscriptionDescription("hook", SubscriptionSettings(topic="o", push_config=signed), "Stable", (), ()))


def test_push_settings_survive_redis_json_and_the_durable_record() -> None:
    """SUB-3 for push subscriptions: every push setting reads back equal, from Redis's JSON and from
    the Avro record of the durable copy."""
    config = PushConfig(URL, no_wrapper=True, request_timeout=2.5, max_concurrent_requests=7,
                        jwt_private_key=_pem(RSA_KEY), jwt_algorithm="PS256", jwt_issuer="me", jwt_key_id="k",
                        jwt_lifetime=60)
    settings = SubscriptionSettings(topic="orders", push_config=config)
    assert SubscriptionSettings.from_json(settings.to_json()) == settings
    assert decode_settings(encode_settings("hook", settings)) == ("hook", settings)


def test_a_record_written_before_push_config_still_reads() -> None:
    """The durable copies written by earlier releases (``subscription_v1``) read back, without push."""
    settings = SubscriptionSettings(topic="orders")
    raw = {"name": "old", **{k: v for k, v in json.loads(settings.to_json()).items() if k != "push_config"},
           "created_at_ms": 1}
    assert decode_settings(encode("subscription_v1", raw)) == ("old", settings)


def test_a_static_token_is_sent_as_bearer() -> None:
    assert Authorizer(PushConfig(URL, bearer_token=TOKEN), "hook").header() == f"Bearer {TOKEN}"
    assert Authorizer(PushConfig(URL), "hook").header() is None


def test_the_jwt_names_the_endpoint_and_is_renewed_at_half_its_lifetime() -> None:
    """PSH-3: a JWT the endpoint verifies with the public key: audience the endpoint, subject the
    subscription, short expiry; the same token until half of its lifetime passed."""
    now = [1_800_000_000.0]
    key = ec.generate_private_key(ec.SECP256R1())
    authorizer = Authorizer(PushConfig(URL, jwt_private_key=_pem(key), jwt_algorithm="ES256", jwt_issuer="iss",
                                       jwt_key_id="k1", jwt_lifetime=100), "hook", clock=lambda: now[0])
    first = authorizer.header()
    assert first is not None and first.startswith("Bearer ")
    token = first.removeprefix("Bearer ")
    claims = jwt.decode(token, key.public_key(), algorithms=["ES256"], audience=URL, issuer="iss",
                        options={"verify_exp": False, "verify_iat": False})
    assert claims["sub"] == "hook" and claims["exp"] - claims["iat"] == 100
    assert jwt.get_unverified_header(token)["kid"] == "k1"
    now[0] += 49
    assert authorizer.header() == first
    now[0] += 2
    assert authorizer.header() != first


def test_a_key_that_cannot_sign_is_refused_without_its_text() -> None:
    """PSH-3: an RSA key for ES256 fails at start, and the error does not quote the key."""
    with pytest.raises(ConfigError) as refused:
        Authorizer(PushConfig(URL, jwt_private_key=_pem(RSA_KEY), jwt_algorithm="ES256"), "hook")
    assert _pem(RSA_KEY).splitlines()[1] not in str(refused.value)


def test_the_gate_sends_one_probe_at_a_time_backing_off_until_an_answer() -> None:
    """While the endpoint is unreachable one request goes at a time, after a wait that doubles;
    an HTTP answer opens the gate for every waiting request."""

    async def scenario() -> list[str]:
        events: list[str] = []
        now = [0.0]
        gate = EndpointGate(initial=0.1, maximum=0.4, clock=lambda: now[0])
        assert gate.is_open and not await gate.enter()
        await gate.unreachable(probe=False)
        await gate.unreachable(probe=False)  # sent before it closed: no longer wait for it
        assert gate.failures == 1 and gate.wait_left() == pytest.approx(0.1)

        async def request(name: str) -> bool:
            probe = await gate.enter()
            events.append(f"{name}{'*' if probe else ''}")
            return probe

        waiting = [asyncio.create_task(request(n)) for n in "abc"]
        await asyncio.sleep(0.01)
        assert events == []  # the wait is not over
        now[0] = 0.1
        async with gate._changed:
            gate._changed.notify_all()
        await asyncio.sleep(0.01)
        assert events == ["a*"]  # one probe; the others wait for its outcome
        await gate.unreachable(probe=True)
        assert gate.failures == 2 and gate.wait_left() == pytest.approx(0.2)
        now[0] = 0.35
        async with gate._changed:
            gate._changed.notify_all()
        await asyncio.sleep(0.01)
        assert events == ["a*", "b*"]
        await gate.answered(probe=True)
        await asyncio.gather(*waiting)
        assert gate.is_open
        return events

    assert asyncio.run(scenario()) == ["a*", "b*", "c"]


def test_the_gate_waits_at_most_maximum() -> None:
    async def scenario() -> float:
        gate = EndpointGate(initial=0.1, maximum=0.4, clock=lambda: 0.0)
        for _ in range(6):
            gate._probing = True
            await gate.unreachable(probe=True)
        return gate.wait_left()

    assert asyncio.run(scenario()) == pytest.approx(0.4)


def test_closing_the_gate_ends_its_waits() -> None:
    """A stopping pusher's requests waiting for the endpoint are let through at once (to be nacked)."""

    async def scenario() -> list[bool]:
        gate = EndpointGate(initial=60.0, clock=lambda: 0.0)
        await gate.unreachable(probe=False)
        waiting = [asyncio.create_task(gate.enter()) for _ in range(3)]
        await asyncio.sleep(0)
        assert not any(task.done() for task in waiting)
        await gate.close()
        return list(await asyncio.gather(*waiting))

    assert asyncio.run(scenario()) == [False, False, False]


@dataclass
class AckedMessage:
    """What ``Subscriber.acknowledge`` reads of a message (``message.ack_all``): ``_ack_queued`` (here
    never queued: a message no engine released) and its engine's ``_submit``."""

    name: str
    _submit: Callable[[list[AckedMessage]], None]
    settled: int = False

    def _ack_queued(self) -> bool:
        self.settled = True
        return False


def test_the_acks_of_one_loop_pass_reach_the_engine_as_one_event() -> None:
    """The answers read in one pass ack as one event, sent at the end of that pass (nothing waits
    for a batch to fill)."""
    sent: list[list[str]] = []

    def engine_inbox(batch: list[AckedMessage]) -> None:
        sent.append([message.name for message in batch])

    async def scenario() -> list[bool]:
        acks = PassAcks()
        first = [AckedMessage(name, engine_inbox) for name in "abc"]
        for message in first:
            acks.ack(message)  # type: ignore[arg-type]
        assert sent == [] and not any(message.settled for message in first)  # the pass goes on
        await asyncio.sleep(0)
        later = AckedMessage("d", engine_inbox)
        acks.ack(later)  # type: ignore[arg-type]
        await asyncio.sleep(0)
        return [message.settled is True for message in [*first, later]]

    assert asyncio.run(scenario()) == [True] * 4
    assert sent == [["a", "b", "c"], ["d"]]


class FakePusher:
    subscription, topic, push_endpoint = "hook", "orders", "http://h/p"

    def __init__(self) -> None:
        self.latencies = [0.002, 0.2]

    def metrics_snapshot(self) -> dict[str, object]:
        taken, self.latencies = self.latencies, []
        return {"requests": {"2xx": 5, "5xx": 2, "timeout": 1}, "keys_waiting": 3, "in_flight": 2,
                "request_latency_seconds": taken}


def test_pusher_metrics_are_collected() -> None:
    """Requests by status class, latency histogram, keys waiting; counters kept after unregister."""
    collector, pusher = LayerCollector(), FakePusher()
    collector.register(pusher)
    families = {f.name: f for f in collector.collect()}
    requests = {s.labels["status_class"]: s.value for s in families["ordering_layer_push_requests"].samples
                if s.name.endswith("_total")}
    assert requests == {"2xx": 5, "5xx": 2, "timeout": 1}
    waiting = families["ordering_layer_push_keys_waiting"].samples
    assert [(s.labels, s.value) for s in waiting] == [({"subscription": "hook", "topic": "orders"}, 3)]
    latency = {s.name: s.value for s in families["ordering_layer_push_request_latency_seconds"].samples
               if not s.labels.get("le")}
    assert latency["ordering_layer_push_request_latency_seconds_count"] == 2
    collector.unregister(pusher)
    families = {f.name: f for f in collector.collect()}
    kept = [s.value for s in families["ordering_layer_push_requests"].samples if s.name.endswith("_total")]
    assert sorted(kept) == [1, 2, 5]
