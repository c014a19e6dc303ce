"""Push subscriptions against a real HTTP endpoint (``tests.push_endpoint``, aiohttp's server).

The endpoint records every request as a delivery, and what it answered as the ack or nack
(``DeliveryChecker``), so per-key order, cascades and nothing lost are checked where the messages
arrive. Waits are on the endpoint's condition with a timeout, never sleeps.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import jwt
import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ordering_layer import Admin, DeadLetterPolicy, OrderedProducer
from ordering_layer.cli import main as cli_main
from ordering_layer.config import PushConfig
from ordering_layer.deadletter import DeadLetter
from ordering_layer.push import Pusher
from ordering_layer.stack import Endpoints
from ordering_layer.stack.certs import make_certificates
from tests.checker import DeliveryChecker, wait_until
from tests.integration.conftest import NO_BACKOFF, cli_servers, publish_keys
from tests.push_endpoint import PushEndpoint, Received

pytestmark = pytest.mark.integration

# How long the endpoint stays down in the outage test (the 20 s, shortened for CI's budget:
# the property, nothing lost and one request per backoff step, shows after a few seconds).
DOWN_SECONDS = float(os.environ.get("ORDERING_LAYER_PUSH_DOWN_SECONDS", "5"))
TOKEN = "s3cr3t-token-9f8e7d"  # a test secret, looked for in the logs


@pytest.fixture
def endpoint() -> Iterator[PushEndpoint]:
    """A push endpoint answering 200 (tests set ``answer``)."""
    server = PushEndpoint()
    yield server
    server.close()


@pytest.fixture
def push_subscription(admin: Admin, topic_factory: Callable[..., str],
                      unique_name: Callable[[str], str]) -> Callable[..., tuple[str, str]]:
    """Creates a topic and a push subscription of it; returns (topic, subscription)."""

    def create(push_config: PushConfig, partitions: int = 3, **settings: object) -> tuple[str, str]:
        topic = topic_factory(partitions=partitions)
        name = unique_name("push")
        settings.setdefault("retry_policy", NO_BACKOFF)
        admin.create_subscription(name, topic=topic, push_config=push_config, **settings)  # type: ignore[arg-type]
        return topic, name

    return create


def recording(checker: DeliveryChecker, decide: Callable[[Received], tuple[int, float]],
              request_timeout: float = 30.0) -> Callable[[Received], tuple[int, float]]:
    """An endpoint answer that records each request as a delivery and its answer as the ack or nack
    (an answer later than the pusher's request timeout counts as a nack at the timeout)."""

    def answer(seen: Received) -> tuple[int, float]:
        status, delay = decide(seen)
        checker.record(seen.message_id, "endpoint", seen.attempt, "deliver", at=seen.at)
        if delay >= request_timeout:
            # The pusher gave up at its timeout (slightly after the request left it): a nack then.
            checker.record(seen.message_id, "endpoint", seen.attempt, "nack", at=seen.at + request_timeout - 0.05)
        else:
            action = "ack" if status in (102, 200, 201, 202, 204) else "nack"
            checker.record(seen.message_id, "endpoint", seen.attempt, action, at=seen.at + delay)
        return status, delay

    return answer


def all_acked(checker: DeliveryChecker) -> Callable[[list[Received]], bool]:
    """The endpoint condition: every published message was answered with an ack."""
    return lambda _: checker.acked_count() >= checker.total()


def answered(pusher: Pusher, endpoint: PushEndpoint, earlier: int = 0, timeout: float = 10.0) -> None:
    """Wait until the pusher has counted an outcome for every request the endpoint received (but
    the ``earlier`` ones, of other pushers)."""
    deadline = time.monotonic() + timeout
    while sum(pusher.requests.values()) < endpoint.count() - earlier:
        assert time.monotonic() < deadline, f"{pusher.requests} for {endpoint.count()} requests"
        threading.Event().wait(0.01)


def test_key_order_with_failed_requests(endpoint: PushEndpoint, endpoints: Endpoints,
                                        push_subscription: Callable[..., tuple[str, str]]) -> None:
    """PSH-1, PSH-2: Pub/Sub's push body; 10 % of requests answered 500 are nacked and retried, each
    key's messages arrive in order with one request per key outstanding, at most
    ``max_concurrent_requests`` in flight; the metrics count the requests by status class."""
    topic, name = push_subscription(PushConfig(endpoint.url, max_concurrent_requests=8))
    kafka = endpoints.kafka_config()
    checker = publish_keys(kafka, topic, keys=40, per_key=10)
    rng, lock = random.Random(35), threading.Lock()

    def decide(_: Received) -> tuple[int, float]:
        with lock:
            failed = rng.random() < 0.10
        return (500 if failed else 200), 0.01

    endpoint.answer = recording(checker, decide)
    with Pusher(kafka, name, redis_url=endpoints.redis_url) as pusher:
        endpoint.wait_for(all_acked(checker), 60, "every message acked")
        answered(pusher, endpoint)
        requests = dict(pusher.requests)
    assert checker.verify() == []
    nacks = sum(1 for e in checker.events if e.action == "nack")
    assert nacks > 0 and requests == {"2xx": checker.total(), "5xx": nacks}
    assert 1 < endpoint.most_in_flight <= 8
    first = endpoint.received[0]
    body, message = first.json, first.message
    assert body["subscription"] == name and body["deliveryAttempt"] >= 1
    assert first.headers["Content-Type"] == "application/json" and "Authorization" not in first.headers
    key = first.data.decode().partition(":")[0]
    assert message["orderingKey"] == key and message["message_id"] == message["messageId"]
    assert message["publishTime"] == message["publish_time"]
    assert abs(datetime.fromisoformat(message["publishTime"]).timestamp() - time.time()) < 120
    retried = [r for r in endpoint.received if r.attempt > 1]
    assert retried, "a failed request's message came again with a higher deliveryAttempt"


def test_no_wrapper_posts_the_payload_with_attribute_headers(endpoint: PushEndpoint, endpoints: Endpoints,
                                                              push_subscription: Callable[..., tuple[str, str]],
                                                              ) -> None:
    """PSH-1: with ``no_wrapper`` the body is the payload byte for byte and the attributes are headers."""
    topic, name = push_subscription(PushConfig(endpoint.url, no_wrapper=True), partitions=1)
    kafka = endpoints.kafka_config()
    payloads = [bytes([0, 255, n]) + b"raw" for n in range(5)]
    with OrderedProducer(kafka) as producer:
        for n, payload in enumerate(payloads):
            producer.publish(topic, payload, ordering_key="k", attributes={"x-seq": str(n), "kind": "raw"}).result(30)
    with Pusher(kafka, name, redis_url=endpoints.redis_url):
        endpoint.wait_for(lambda got: len(got) >= 5, 30, "5 requests")
    got = endpoint.received[:5]
    assert [r.body for r in got] == payloads
    assert [r.headers["x-seq"] for r in got] == ["0", "1", "2", "3", "4"]
    assert all(r.headers["kind"] == "raw" and r.headers["Content-Type"] == "application/octet-stream" for r in got)


def test_timed_out_requests_are_nacked_and_retried(endpoint: PushEndpoint, endpoints: Endpoints,
                                                   push_subscription: Callable[..., tuple[str, str]]) -> None:
    """PSH-1: a request not answered within ``request_timeout`` nacks; the message comes again, in order."""
    topic, name = push_subscription(PushConfig(endpoint.url, request_timeout=1.0))
    kafka = endpoints.kafka_config()
    checker = publish_keys(kafka, topic, keys=6, per_key=5)
    slow = {ids[2] for ids in checker.published.values()}  # each key's third message, first attempt
    endpoint.answer = recording(checker, lambda seen: (200, 1.6 if seen.message_id in slow and seen.attempt == 1
                                                       else 0.0), request_timeout=1.0)
    with Pusher(kafka, name, redis_url=endpoints.redis_url) as pusher:
        endpoint.wait_for(all_acked(checker), 60, "every message acked")
        assert pusher.requests["timeout"] == len(slow)
    assert checker.verify() == []
    assert sorted(r.attempt for r in endpoint.received if r.message_id in slow) == sorted([1, 2] * len(slow))


def test_endpoint_down_loses_nothing_and_does_not_spin(endpoint: PushEndpoint, endpoints: Endpoints,
                                                       push_subscription: Callable[..., tuple[str, str]]) -> None:
    """PSH-1: refused connections nack; while the endpoint is down the pusher probes it with growing
    waits instead of sending every message (no busy loop, even with no retry backoff), and once it
    is back every message arrives, in key order."""
    concurrency = 10
    topic, name = push_subscription(PushConfig(endpoint.url, max_concurrent_requests=concurrency))
    kafka = endpoints.kafka_config()
    checker = publish_keys(kafka, topic, keys=20, per_key=10)
    endpoint.answer = recording(checker, lambda _: (200, 0.02))
    with Pusher(kafka, name, redis_url=endpoints.redis_url) as pusher:
        endpoint.wait_for(lambda got: len(got) >= 40, 30, "40 requests before the outage")
        endpoint.stop()
        down_at = time.monotonic()
        before = pusher.requests["error"]
        # The outage itself is a duration, not a synchronisation: the requests in flight fail in
        # its first second, then only the probes go.
        threading.Event().wait(1.0)
        settled = pusher.requests["error"]
        threading.Event().wait(DOWN_SECONDS - 1.0)
        probes = pusher.requests["error"] - settled
        refused = pusher.requests["error"] - before
        endpoint.start()
        endpoint.wait_for(all_acked(checker), 60, "every message acked after the outage")
        recovered_in = time.monotonic() - down_at - DOWN_SECONDS
    assert checker.verify() == []
    # A busy loop would make thousands of requests; the gate makes one per wait (0.1 s doubling),
    # after the requests that were in flight or just past the gate when the endpoint went away.
    steps = sum(1 for n in range(1, 30) if sum(min(10.0, 0.1 * 2 ** i) for i in range(n)) < DOWN_SECONDS)
    assert 1 <= probes <= steps, f"{probes} probes in the last {DOWN_SECONDS - 1:g} s of the outage"
    assert refused <= 2 * concurrency + steps, f"{refused} refused requests in {DOWN_SECONDS:g} s"
    assert recovered_in < min(10.0, DOWN_SECONDS) + 15


def test_close_finishes_the_requests_in_flight_and_sends_no_more(
        endpoint: PushEndpoint, endpoints: Endpoints, push_subscription: Callable[..., tuple[str, str]]) -> None:
    """PSH-1, PSH-2: closing a pusher whose request slots are all taken lets the requests in flight
    finish (their answers ack) and sends none of the messages waiting for a slot; a later pusher
    delivers those, every key in order, nothing lost."""
    concurrency = 4
    topic, name = push_subscription(PushConfig(endpoint.url, max_concurrent_requests=concurrency))
    kafka = endpoints.kafka_config()
    checker = publish_keys(kafka, topic, keys=20, per_key=3)
    endpoint.answer = recording(checker, lambda _: (200, 0.3))
    with Pusher(kafka, name, redis_url=endpoints.redis_url) as first:
        endpoint.wait_for(lambda _: endpoint.in_flight == concurrency, 30, "every request slot taken")
    sent = endpoint.count()
    assert dict(first.requests) == {"2xx": sent} and first.in_flight == 0
    assert sent < checker.total() and endpoint.most_in_flight == concurrency
    endpoint.answer = recording(checker, lambda _: (200, 0.0))
    with Pusher(kafka, name, redis_url=endpoints.redis_url):
        endpoint.wait_for(all_acked(checker), 60, "every message acked")
    assert checker.verify() == []


def test_poison_is_dead_lettered_after_exactly_max_attempts(endpoint: PushEndpoint, endpoints: Endpoints, admin: Admin,
                                                            push_subscription: Callable[..., tuple[str, str]],
                                                            unique_name: Callable[[str], str]) -> None:
    """PSH-1, DLQ-2: a message the endpoint answers 500 forever is requested exactly
    ``max_delivery_attempts`` times, then dead-lettered; its key goes on with its next messages."""
    dlq = unique_name("dlq")
    topic, name = push_subscription(PushConfig(endpoint.url), partitions=2,
                                    dead_letter_policy=DeadLetterPolicy(dlq, max_delivery_attempts=5))
    kafka = endpoints.kafka_config()
    checker = publish_keys(kafka, topic, keys=3, per_key=4)
    poison = checker.published["key-1"][1]
    endpoint.answer = recording(checker, lambda seen: (500 if seen.message_id == poison else 204, 0.0))
    others = checker.total() - 1
    with Pusher(kafka, name, redis_url=endpoints.redis_url):
        endpoint.wait_for(lambda _: checker.acked_count() >= others, 60, "every other message acked")
        letters: list[DeadLetter] = []
        deadline = time.monotonic() + 30
        while not letters and time.monotonic() < deadline:
            letters = admin.list_dead_letters(name)
    assert [r.attempt for r in endpoint.received if r.message_id == poison] == [1, 2, 3, 4, 5]
    assert len(letters) == 1 and letters[0].delivery_attempts == 5 and letters[0].last_error == "HTTP 500"
    checker.record(poison, "endpoint", 5, "dead")
    assert checker.verify(max_delivery_attempts=5) == []


def _pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


def test_bearer_token_jwt_and_tls_verified_by_the_endpoint(
        tmp_path: Path, endpoints: Endpoints, push_subscription: Callable[..., tuple[str, str]],
        caplog: pytest.LogCaptureFixture) -> None:
    """PSH-3: the endpoint (https, certificate of a private CA) accepts the static token and a JWT
    signed with the subscription's key (audience: the endpoint, short expiry); without the CA bundle
    the certificate is refused; the secrets appear in no log line, repr or describe output."""
    tls = make_certificates(tmp_path, "pw")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.cert, tls.key)
    server = PushEndpoint(tls=context)
    key = ec.generate_private_key(ec.SECP256R1())
    public = key.public_key()
    seen_claims: list[dict[str, object]] = []

    def check(seen: Received) -> tuple[int, float]:
        auth = seen.headers.get("Authorization", "")
        if auth == f"Bearer {TOKEN}":
            return 200, 0.0
        try:
            claims = jwt.decode(auth.removeprefix("Bearer "), public, algorithms=["ES256"], audience=server.url,
                                issuer="orders-pusher")
        except jwt.PyJWTError:
            return 401, 0.0
        if jwt.get_unverified_header(auth.removeprefix("Bearer ")).get("kid") != "k1":
            return 401, 0.0
        seen_claims.append(claims)
        return 200, 0.0

    server.answer = check
    ca = tls.ca.read_text()
    caplog.set_level(logging.DEBUG)
    kafka = endpoints.kafka_config()
    try:
        configs = {
            "token": PushConfig(server.url, bearer_token=TOKEN, ca_bundle=ca),
            "jwt": PushConfig(server.url, jwt_private_key=_pem(key), jwt_algorithm="ES256", jwt_issuer="orders-pusher",
                              jwt_key_id="k1", jwt_lifetime=60, ca_bundle=ca),
            "no-ca": PushConfig(server.url, bearer_token=TOKEN),
        }
        made = {label: push_subscription(config, partitions=1) for label, config in configs.items()}
        for topic, _ in made.values():
            with OrderedProducer(kafka) as producer:
                for n in range(3):
                    producer.publish(topic, f"m{n}".encode(), ordering_key="k").result(30)
        for label in ("token", "jwt"):
            before = server.count()
            with Pusher(kafka, made[label][1], redis_url=endpoints.redis_url) as pusher:
                server.wait_for(lambda got: len(got) >= before + 3, 30, f"3 requests with {label}")  # noqa: B023
                answered(pusher, server, before)
                assert pusher.requests == {"2xx": 3}, label
        assert len(seen_claims) == 3
        claims = seen_claims[0]
        assert claims["sub"] == made["jwt"][1] and 0 < int(claims["exp"]) - int(claims["iat"]) <= 60  # type: ignore[call-overload]
        before = server.count()
        with Pusher(kafka, made["no-ca"][1], redis_url=endpoints.redis_url) as pusher:
            deadline = time.monotonic() + 20
            while pusher.requests["error"] < 2 and time.monotonic() < deadline:
                threading.Event().wait(0.1)
            assert pusher.requests["error"] >= 2 and "2xx" not in pusher.requests
        assert server.count() == before, "no HTTP request reached the endpoint over an unverified connection"
        described = CliRunner().invoke(cli_main, ["subscription", "describe", made["jwt"][1], "--json",
                                                  *cli_servers(endpoints)])
        described_token = CliRunner().invoke(cli_main, ["subscription", "describe", made["token"][1],
                                                        *cli_servers(endpoints)])
    finally:
        server.close()
    assert described.exit_code == 0 and described_token.exit_code == 0, described.output + described_token.output
    assert json.loads(described.output)["settings"]["push_config"]["jwt_private_key"] == "<set>"
    assert "static bearer token" in described_token.output
    secret_key = _pem(key).splitlines()[1]
    for text in (caplog.text, described.output, described_token.output, repr(configs)):
        assert TOKEN not in text and secret_key not in text


def _push_process(endpoints: Endpoints, name: str, log: Path, props: Path) -> subprocess.Popen[bytes]:
    servers = cli_servers(endpoints)
    if "--kafka-config" in servers:  # the stack's own settings file, with the session timeout added
        index = servers.index("--kafka-config")
        props.write_text(Path(servers[index + 1]).read_text() + "\nsession.timeout.ms=6000\n")
        servers[index + 1] = str(props)
    else:
        props.write_text("session.timeout.ms=6000\n")
        servers += ["--kafka-config", str(props)]
    script = Path(sys.executable).parent / "ordering-layer"
    return subprocess.Popen([str(script), "-v", "push", name, *servers], stdout=log.open("wb"),
                            stderr=subprocess.STDOUT)


def test_two_pusher_processes_one_killed(tmp_path: Path, endpoint: PushEndpoint, endpoints: Endpoints,
                                         push_subscription: Callable[..., tuple[str, str]]) -> None:
    """PSH-2, SUB-3: two ``ordering-layer push`` processes share a subscription; one is killed with
    SIGKILL midway: nothing is lost, each key stays in order with one request outstanding, and the
    other stops gracefully on SIGTERM. The bearer token is in neither process's log."""
    topic, name = push_subscription(PushConfig(endpoint.url, bearer_token=TOKEN, max_concurrent_requests=10),
                                    partitions=6)
    kafka = endpoints.kafka_config()
    checker = publish_keys(kafka, topic, keys=30, per_key=40)
    endpoint.answer = recording(checker, lambda seen: (200 if seen.headers.get("Authorization") == f"Bearer {TOKEN}"
                                                       else 401, 0.05))
    logs = [tmp_path / "pusher-a.log", tmp_path / "pusher-b.log"]
    pushers = [_push_process(endpoints, name, logs[i], tmp_path / f"client-{i}.properties") for i in range(2)]
    try:
        wait_until(lambda: all("claimed partition" in log.read_text() for log in logs), 60,
                   "both pushers owning partitions")
        sent = endpoint.count()
        endpoint.wait_for(lambda got: len(got) >= sent + 100, 60, "100 more requests")
        pushers[0].send_signal(signal.SIGKILL)
        pushers[0].wait(10)
        endpoint.wait_for(all_acked(checker), 90, "every message acked by the surviving pusher")
        pushers[1].send_signal(signal.SIGTERM)
        assert pushers[1].wait(40) == 0
    finally:
        for process in pushers:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    assert checker.verify() == []
    assert all(r.headers.get("Authorization") == f"Bearer {TOKEN}" for r in endpoint.received)
    texts = [log.read_text() for log in logs]
    assert "stopped" in texts[1]
    assert all(TOKEN not in text for text in texts)
