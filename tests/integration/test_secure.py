"""The layer through a secured stack: Kafka SASL_SSL (SCRAM-SHA-512) and Redis over TLS with an ACL
user, certificates from the stack's own CA. Publish, subscribe, dead letters, describe and the CLI work
through it; a wrong password or CA fails fast naming the server; no secret reaches logs, output,
errors or reprs.

The stack comes from the plugin's ``ordering_layer_secure_stack`` fixture: the session's own when it
is secured (``make test-secure``), else one started for this session.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
from click.testing import CliRunner

from ordering_layer import Admin, DeadLetterPolicy, Message, OrderedConsumer, OrderedProducer, Subscriber
from ordering_layer.cli import main
from ordering_layer.errors import AuthenticationError, OrderingLayerError, SubscriptionNotFoundError
from ordering_layer.kafka.auth import verify_kafka
from ordering_layer.stack import Endpoints, LocalStack
from ordering_layer.stack.certs import make_certificates
from ordering_layer.state import StateStore
from ordering_layer.state.client import url_with_credentials
from ordering_layer.state.store import settings_key
from tests.checker import wait_until
from tests.integration.conftest import NO_BACKOFF, publish_keys

pytestmark = [pytest.mark.integration, pytest.mark.secure]


@pytest.fixture(scope="module")
def secure(ordering_layer_secure_stack: LocalStack) -> Endpoints:
    """The secured stack's endpoints (``rediss://`` URL with the ACL user, Kafka client properties)."""
    return ordering_layer_secure_stack.endpoints()


@pytest.fixture(scope="module")
def passwords(secure: Endpoints) -> list[str]:
    """The secrets a client holds: the Kafka SCRAM password and the Redis ACL password."""
    redis_password = unquote(urlsplit(secure.redis_url).password or "")
    found = [str(secure.kafka_config()["sasl.password"]), redis_password]
    assert all(len(p) >= 16 for p in found)
    return found


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CA certificate of another authority, which did not sign the stack's servers."""
    return make_certificates(tmp_path_factory.mktemp("other-ca"), "unused").ca


def cli_env(endpoints: Endpoints) -> dict[str, str]:
    return {"ORDERING_LAYER_BOOTSTRAP": endpoints.bootstrap, "ORDERING_LAYER_REDIS_URL": endpoints.redis_url,
            "ORDERING_LAYER_KAFKA_CONFIG": endpoints.kafka_config_file}


def test_publish_subscribe_dead_letter_and_describe_through_tls_and_authentication(
        secure: Endpoints, unique_name: Callable[[str], str]) -> None:
    """SUB-1, DLQ-2, DLQ-5, ACK-4 over SASL_SSL and TLS Redis: per-key order, a poison message dead-lettered
    through the secured dead-letter producer and listed, the backlog described, an OrderedConsumer too."""
    kafka = secure.kafka_config()
    assert kafka["security.protocol"] == "SASL_SSL" and secure.redis_url.startswith("rediss")
    admin = Admin(kafka, redis_url=secure.redis_url)
    topic, name = unique_name("sec-topic"), unique_name("sec-sub")
    admin.create_topic(topic, partitions=2)
    admin.create_subscription(name, topic=topic, retry_policy=NO_BACKOFF,
                              dead_letter_policy=DeadLetterPolicy(f"{name}.dlq", max_delivery_attempts=5))
    checker = publish_keys(kafka, topic, keys=4, per_key=5)
    with OrderedProducer(kafka) as producer:
        producer.publish(topic, b"poison", ordering_key="key-0").result(timeout=60)
    acked: dict[str, list[bytes]] = {}

    def callback(message: Message) -> None:
        if message.data == b"poison":
            message.nack()
            return
        acked.setdefault(message.ordering_key, []).append(message.data)
        message.ack()

    with Subscriber(kafka, redis_url=secure.redis_url).subscribe(name, callback, max_workers=4):
        wait_until(lambda: sum(map(len, acked.values())) == checker.total()
                   and len(admin.list_dead_letters(name)) == 1, 90, "every message acked and the poison dead-lettered")
    assert acked == {f"key-{k}": [f"key-{k}:{n}".encode() for n in range(5)] for k in range(4)}
    assert [(letter.ordering_key, letter.source_topic, letter.delivery_attempts)
            for letter in admin.list_dead_letters(name)] == [("key-0", topic, 5)]
    wait_until(lambda: admin.describe_subscription(name).backlog == 0, 60, "the backlog described as 0")

    consumer = OrderedConsumer({**kafka, "group.id": unique_name("sec-group"), "auto.offset.reset": "earliest"},
                               redis_url=secure.redis_url)
    consumer.subscribe([topic])
    seen: list[bytes] = []
    try:
        deadline = time.monotonic() + 60
        while len(seen) < checker.total() + 1 and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is not None:
                seen.append(message.data)
                message.ack()
    finally:
        consumer.close()
    assert sorted(seen) == sorted([b"poison"] + [f"key-{k}:{n}".encode() for k in range(4) for n in range(5)])
    admin.delete_subscription(name)


def test_cli_through_the_secured_stack(secure: Endpoints, unique_name: Callable[[str], str]) -> None:
    """The CLI takes the Kafka client settings from ORDERING_LAYER_KAFKA_CONFIG and the rediss:// URL:
    topic create, subscription create/describe, publish, pull with ack, dead-letter list."""
    runner, env = CliRunner(), cli_env(secure)
    topic, name = unique_name("sec-cli-topic"), unique_name("sec-cli-sub")
    for args in (["topic", "create", topic], ["subscription", "create", name, "--topic", topic,
                                              "--dead-letter-topic", f"{name}.dlq"]):
        result = runner.invoke(main, args, env=env)
        assert result.exit_code == 0, result.output
    published = runner.invoke(main, ["publish", topic, "--ordering-key", "k"], input="one\ntwo\n", env=env)
    assert published.exit_code == 0, published.output
    pulled = runner.invoke(main, ["pull", name, "--max-messages", "2", "--timeout", "30"], env=env)
    assert pulled.exit_code == 0, pulled.output
    assert [line.split("\t")[-1] for line in pulled.output.splitlines() if line.startswith("k\t")] == ["one", "two"]
    assert runner.invoke(main, ["deadletter", "list", name], env=env).exit_code == 0
    described = runner.invoke(main, ["subscription", "describe", name, "--json"], env=env)
    assert described.exit_code == 0 and '"backlog"' in described.output


def test_wrong_password_or_ca_fails_fast_naming_the_server(secure: Endpoints, other_ca: Path) -> None:
    """A refused SASL login, an untrusted broker certificate, a refused Redis user or password and an
    untrusted Redis certificate each raise ``AuthenticationError`` naming the server, within seconds."""
    kafka = secure.kafka_config()
    cases: list[tuple[str, Callable[[], object]]] = [
        ("kafka", lambda: Admin({**kafka, "sasl.password": "not-the-password"})),
        ("kafka", lambda: Admin({**kafka, "sasl.username": "nobody"})),
        ("kafka", lambda: verify_kafka({**kafka, "ssl.ca.location": str(other_ca)})),
        ("redis", lambda: StateStore(url_with_credentials(secure.redis_url, "ol", "not-the-password"))),
        ("redis", lambda: Subscriber(kafka, redis_url=url_with_credentials(secure.redis_url, "nobody", "x"))),
        ("redis", lambda: Admin(kafka, redis_url=secure.redis_url.replace(
            str(Path(secure.kafka_config()["ssl.ca.location"])), str(other_ca))).describe_subscription("any")),
    ]
    for server, attempt in cases:
        started = time.monotonic()
        with pytest.raises(AuthenticationError) as raised:
            attempt()
        assert raised.value.server == server, raised.value
        assert time.monotonic() - started < 5, f"{server}: {raised.value} took {time.monotonic() - started:.1f} s"


def test_subscriber_and_consumer_fail_fast_on_a_wrong_kafka_password(
        secure: Endpoints, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> None:
    """A ``Subscriber`` and an ``OrderedConsumer`` given a wrong SASL password raise
    ``AuthenticationError`` naming Kafka at construction, within seconds (before, they started and
    retried the login forever); the wrong password and the right one reach no error and no log."""
    caplog.set_level(logging.DEBUG)
    kafka = secure.kafka_config()
    wrong = f"wrong-{uuid.uuid4().hex}"
    bad = {**kafka, "sasl.password": wrong}
    constructors: list[Callable[[], object]] = [
        lambda: Subscriber(bad, redis_url=secure.redis_url),
        lambda: OrderedConsumer({**bad, "group.id": "never-joined"}, redis_url=secure.redis_url),
    ]
    seen: list[str] = []
    for construct in constructors:
        started = time.monotonic()
        with pytest.raises(AuthenticationError) as raised:
            construct()
        assert time.monotonic() - started < 5, f"{raised.value} took {time.monotonic() - started:.1f} s"
        assert raised.value.server == "kafka" and str(raised.value).startswith("Kafka refused the SASL credentials")
        seen += [str(raised.value), repr(raised.value)]
    captured = capfd.readouterr()
    text = "\n".join([caplog.text, captured.out, captured.err, *seen])
    assert "SASL authentication error" in text
    for secret in (wrong, str(kafka["sasl.password"])):
        assert secret not in text


def test_secrets_never_reach_logs_output_errors_or_reprs(
        secure: Endpoints, passwords: list[str], unique_name: Callable[[str], str],
        caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> None:
    """Publish, subscribe, describe and the CLI, with wrong and with right passwords, logging at DEBUG:
    neither password (nor a wrong one tried) appears in the logs, the printed output, an error or a repr."""
    caplog.set_level(logging.DEBUG)
    wrong = [f"wrong-{uuid.uuid4().hex}", f"wrong-{uuid.uuid4().hex}"]
    kafka = secure.kafka_config()
    bad_kafka = {**kafka, "sasl.password": wrong[0], "message.timeout.ms": 3000}
    bad_redis = url_with_credentials(secure.redis_url, "ol", wrong[1])
    seen: list[str] = []

    def attempt(call: Callable[[], object]) -> None:
        try:
            seen.append(repr(call()))
        except OrderingLayerError as exc:
            seen.extend([str(exc), repr(exc)])

    attempt(lambda: Admin(bad_kafka))
    attempt(lambda: Admin(kafka, redis_url=bad_redis).describe_subscription("any"))
    attempt(lambda: Subscriber(kafka, redis_url=bad_redis))
    topic, name = unique_name("sec-secret-topic"), unique_name("sec-secret-sub")
    admin = Admin(kafka, redis_url=secure.redis_url)
    admin.create_topic(topic)
    admin.create_subscription(name, topic=topic)
    with OrderedProducer(kafka) as producer:
        producer.publish(topic, b"hello", ordering_key="k").result(timeout=60)
    with Subscriber(kafka, redis_url=secure.redis_url) as subscriber:
        deadline = time.monotonic() + 30
        pulled: list[Message] = []
        while not pulled and time.monotonic() < deadline:
            pulled = subscriber.pull(name, max_messages=1, timeout=0.5)
        assert pulled and pulled[0].data == b"hello"
        seen.append(repr(pulled[0]))
        pulled[0].ack()
    seen += [repr(admin), repr(admin.store), repr(admin.store.client), repr(secure),
             str(admin.describe_subscription(name))]
    runner = CliRunner()
    for env in (cli_env(secure), {**cli_env(secure), "ORDERING_LAYER_REDIS_URL": bad_redis}):
        for args in (["subscription", "describe", name], ["pull", name, "--timeout", "1"],
                     ["publish", topic, "--ordering-key", "k"]):
            result = runner.invoke(main, args, env=env, input="cli\n")
            seen += [result.output, repr(result.exception)]
    for args in (["stack", "status", "--state-dir", str(Path(secure.kafka_config_file).parent)],
                 ["stack", "up", "--state-dir", str(Path(secure.kafka_config_file).parent)]):
        result = runner.invoke(main, args)
        assert result.exit_code == 0, result.output
        seen.append(result.output)
    admin.delete_subscription(name)
    captured = capfd.readouterr()
    text = "\n".join([caplog.text, captured.out, captured.err, *seen])
    assert "SASL authentication error" in text and "refused the credentials" in text, "the wrong logins ran"
    for secret in [*passwords, *wrong]:
        assert secret not in text


def test_stack_env_prints_what_a_client_needs(secure: Endpoints, passwords: list[str]) -> None:
    """``stack env`` of a secured stack names the Kafka client settings file and the rediss:// URL with
    its credentials and CA (the one place that prints them: it is how a client gets them)."""
    state_dir = str(Path(secure.kafka_config_file).parent)
    result = CliRunner().invoke(main, ["stack", "env", "--state-dir", state_dir])
    assert result.exit_code == 0, result.output
    assert f"export ORDERING_LAYER_KAFKA_CONFIG={secure.kafka_config_file}" in result.output
    assert re.search(r"ORDERING_LAYER_REDIS_URL='rediss(\+cluster)?://ol:", result.output)
    assert "ssl_ca_certs=" in result.output
    assert passwords[1] in result.output
    settings: dict[str, Any] = secure.kafka_config()
    assert settings["sasl.mechanism"] == "SCRAM-SHA-512" and Path(settings["ssl.ca.location"]).exists()


def test_producer_with_a_wrong_password_fails_fast_without_revealing_it(
        secure: Endpoints, passwords: list[str], caplog: pytest.LogCaptureFixture,
        capfd: pytest.CaptureFixture[str]) -> None:
    """A wrong SASL password makes ``OrderedProducer(...)`` itself raise ``AuthenticationError`` naming
    Kafka within seconds (not a publish that times out later); neither the wrong nor the right
    password appears in the error or the captured logs and output."""
    caplog.set_level(logging.DEBUG)
    wrong = f"wrong-{uuid.uuid4().hex}"
    started = time.monotonic()
    with pytest.raises(AuthenticationError) as raised:
        OrderedProducer({**secure.kafka_config(), "sasl.password": wrong}, settings={"scheduler": False})
    assert time.monotonic() - started < 5, f"took {time.monotonic() - started:.1f} s"
    assert raised.value.server == "kafka" and str(raised.value).startswith("Kafka refused the SASL credentials")
    captured = capfd.readouterr()
    text = "\n".join([caplog.text, captured.out, captured.err, str(raised.value), repr(raised.value)])
    for secret in [*passwords, wrong]:
        assert secret not in text


def test_subscription_settings_come_back_from_kafka_through_the_secured_stack(
        secure: Endpoints, unique_name: Callable[[str], str]) -> None:
    """SUB-3 over SASL_SSL: the durable copy of a subscription's settings is written and read through
    the secured Kafka config: after Redis lost the settings, the store reads them back and restores them."""
    kafka = secure.kafka_config()
    admin = Admin(kafka, redis_url=secure.redis_url)
    topic, name = unique_name("sec-durable-topic"), unique_name("sec-durable-sub")
    admin.create_topic(topic)
    created = admin.create_subscription(name, topic=topic, ack_deadline=30.0)
    admin.store.client.delete(settings_key(name))
    with pytest.raises(SubscriptionNotFoundError):
        StateStore(secure.redis_url).settings(name)
    assert StateStore(secure.redis_url, kafka_config=kafka).settings(name) == created
    assert StateStore(secure.redis_url).settings(name) == created
    admin.delete_subscription(name)
