"""pytest fixtures for projects that test their code against the layer (entry point ``pytest11``).

Installing ``ordering-layer`` registers this plugin, so a user's test module can ask for:

- ``kafka_bootstrap``: ``host:port`` of a real Kafka broker, one per test session;
- ``redis_url``: ``redis://...`` of a real Redis, one per test session;
- ``kafka_config``: a confluent-kafka config dict naming that broker;
- ``ordering_layer_admin``: an :class:`~ordering_layer.Admin` on both;
- ``subscription_factory``: creates a topic and a subscription of it, with names unique to the
  test, and deletes them after the test;
- ``kafka_cluster``: opt-in, a three-broker Kafka cluster with its own Redis (a ``LocalStack``),
  started by the first test that asks for it, for tests that kill and restart brokers.

Where the services come from: ``ORDERING_LAYER_BOOTSTRAP`` and ``ORDERING_LAYER_REDIS_URL`` name an
existing cluster (``ORDERING_LAYER_KAFKA_CONFIG`` a properties file of further Kafka client settings,
such as TLS and SASL); otherwise the project's launcher starts them, as local processes
(``ORDERING_LAYER_STACK=local``, the default) or in containers (``ORDERING_LAYER_STACK=testcontainers``).
The local stack runs Redis as a three-master Redis Cluster with ``ORDERING_LAYER_REDIS_CLUSTER=1`` and
secures Kafka and Redis (TLS, SASL/SCRAM, an ACL user) with ``ORDERING_LAYER_SECURE=1``.

Two more fixtures start their own servers, only in sessions whose tests ask for them:

- ``ordering_layer_redis_cluster``: a three-master Redis Cluster (``RedisNodes``: its ``url()``,
  ``stop_node``/``start_node`` for restart tests); the session's own when it runs one;
- ``ordering_layer_secure_stack``: a secured Kafka + Redis stack (``LocalStack(secure=True)``).
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ordering_layer.admin import Admin
from ordering_layer.config import SubscriptionSettings
from ordering_layer.stack import Endpoints, LocalStack, StackBackend, get_backend
from ordering_layer.stack.redis_nodes import RedisNodes


@dataclass(frozen=True)
class CreatedSubscription:
    """A topic and a subscription of it, made by ``subscription_factory``."""

    topic: str
    subscription: str
    settings: SubscriptionSettings


def _names_named_by_environment() -> Endpoints | None:
    bootstrap = os.environ.get("ORDERING_LAYER_BOOTSTRAP")
    redis_url = os.environ.get("ORDERING_LAYER_REDIS_URL")
    if bootstrap and redis_url:
        return Endpoints(bootstrap, redis_url, os.environ.get("ORDERING_LAYER_KAFKA_CONFIG", ""))
    return None


@pytest.fixture(scope="session")
def ordering_layer_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackBackend | None]:
    """The session's stack backend, or None when an existing cluster is named by environment."""
    if _names_named_by_environment() is not None:
        yield None
        return
    backend = get_backend(state_dir=Path(tmp_path_factory.mktemp("ordering-layer-stack")))
    try:
        backend.up()
        yield backend
    finally:
        backend.down()


@pytest.fixture(scope="session")
def kafka_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """A three-broker KRaft cluster (topics: 3 replicas, min ISR 2) and a Redis, for the session.

    Only tests that ask for it start it; it is stopped at the end of the session. It always runs as
    local processes (the container backend runs one broker); tests kill and restart its brokers with
    ``stop_broker(node=N, kill=True)`` and ``start_broker(node=N)``. Skipped when the services are
    named by environment, as those cannot be restarted by the tests.
    """
    if _names_named_by_environment() is not None:
        pytest.skip("services named by environment: no cluster whose brokers the tests may kill")
    # Redis as the session's variant asks; never secured, which a three-broker stack does not offer.
    backend = LocalStack(Path(tmp_path_factory.mktemp("ordering-layer-cluster")), secure=False)
    try:
        backend.up(brokers=3)
        yield backend
    finally:
        backend.down()


@pytest.fixture(scope="session")
def ordering_layer_endpoints(ordering_layer_stack: StackBackend | None) -> Endpoints:
    """Bootstrap servers and Redis URL of the session's services."""
    if ordering_layer_stack is None:
        named = _names_named_by_environment()
        assert named is not None
        return named
    return ordering_layer_stack.endpoints()


@pytest.fixture(scope="session")
def kafka_bootstrap(ordering_layer_endpoints: Endpoints) -> str:
    """``host:port`` of the session's Kafka broker."""
    return ordering_layer_endpoints.bootstrap


@pytest.fixture(scope="session")
def redis_url(ordering_layer_endpoints: Endpoints) -> str:
    """``redis://host:port/db`` of the session's Redis."""
    return ordering_layer_endpoints.redis_url


@pytest.fixture(scope="session")
def kafka_config(ordering_layer_endpoints: Endpoints) -> dict[str, Any]:
    """A confluent-kafka config naming the session's broker (with its security settings, if any)."""
    return ordering_layer_endpoints.kafka_config()


@pytest.fixture(scope="session")
def ordering_layer_redis_cluster(ordering_layer_stack: StackBackend | None,
                                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisNodes]:
    """A three-master Redis Cluster: the session stack's when it runs one, else one started for the
    session (stopped at its end)."""
    if isinstance(ordering_layer_stack, LocalStack) and ordering_layer_stack.redis_node_count() > 1:
        yield ordering_layer_stack.redis_nodes()
        return
    nodes = RedisNodes(Path(tmp_path_factory.mktemp("ordering-layer-redis-cluster")), count=3, cluster=True)
    try:
        nodes.up()
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture(scope="session")
def ordering_layer_secure_stack(ordering_layer_stack: StackBackend | None,
                                tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """A secured local stack (TLS, Kafka SASL/SCRAM, a Redis ACL user): the session's when it is one,
    else one started for the session (stopped at its end)."""
    if isinstance(ordering_layer_stack, LocalStack) and ordering_layer_stack.status().get("secure"):
        yield ordering_layer_stack
        return
    stack = LocalStack(Path(tmp_path_factory.mktemp("ordering-layer-secure-stack")), secure=True,
                       redis_cluster=False)
    try:
        stack.up()
        yield stack
    finally:
        stack.down()


@pytest.fixture(scope="session")
def ordering_layer_admin(kafka_config: dict[str, Any], redis_url: str) -> Admin:
    """An ``Admin`` on the session's Kafka and Redis."""
    return Admin(kafka_config, redis_url=redis_url)


def unique_test_name(request: pytest.FixtureRequest, prefix: str) -> str:
    """``<prefix>-<test name>-<8 hex digits>``: a Kafka- and Redis-safe name unique to this test."""
    test = re.sub(r"[^a-zA-Z0-9]+", "-", request.node.name)[:60].strip("-").lower()
    return f"{prefix}-{test}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def subscription_factory(ordering_layer_admin: Admin,
                         request: pytest.FixtureRequest) -> Iterator[Callable[..., CreatedSubscription]]:
    """Creates a topic and a subscription of it; both are deleted after the test.

    ``subscription_factory(partitions=3, enable_message_ordering=True, ack_deadline=10.0, ...)``:
    ``partitions`` sizes the new topic, ``topic=`` subscribes to an existing one instead (not
    deleted afterwards), and other keywords go to :meth:`Admin.create_subscription`.
    """
    made: list[tuple[str, str | None]] = []

    def create(*, partitions: int = 1, topic: str | None = None, **settings: Any) -> CreatedSubscription:
        own_topic = None
        if topic is None:
            topic = own_topic = unique_test_name(request, "topic")
            ordering_layer_admin.create_topic(topic, partitions=partitions)
        name = unique_test_name(request, "sub")
        created = ordering_layer_admin.create_subscription(name, topic=topic, **settings)
        made.append((name, own_topic))
        return CreatedSubscription(topic=topic, subscription=name, settings=created)

    yield create
    for name, own_topic in made:
        ordering_layer_admin.delete_subscription(name)
        if own_topic is not None:
            ordering_layer_admin.delete_topic(own_topic)
