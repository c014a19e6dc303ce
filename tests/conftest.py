"""Session-wide real services: one Kafka broker and one Redis per test session.

By default the project's own launcher starts them (``ORDERING_LAYER_STACK``, default ``local``).
Name an existing cluster instead with ``ORDERING_LAYER_BOOTSTRAP`` and ``ORDERING_LAYER_REDIS_URL``;
tests that restart services are then skipped. Tests are isolated by unique topic names.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ordering_layer import Admin
from ordering_layer.stack import Endpoints, StackBackend, get_backend


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackBackend | None]:
    """The session's stack backend, or None when an existing cluster is named by environment."""
    if os.environ.get("ORDERING_LAYER_BOOTSTRAP") and os.environ.get("ORDERING_LAYER_REDIS_URL"):
        yield None
        return
    backend = get_backend(state_dir=Path(tmp_path_factory.mktemp("stack")))
    backend.up()
    try:
        yield backend
    finally:
        backend.down()


@pytest.fixture(scope="session")
def endpoints(stack: StackBackend | None) -> Endpoints:
    """Bootstrap servers and Redis URL of the session's services."""
    if stack is None:
        return Endpoints(os.environ["ORDERING_LAYER_BOOTSTRAP"], os.environ["ORDERING_LAYER_REDIS_URL"])
    return stack.endpoints()


@pytest.fixture
def restartable(stack: StackBackend | None) -> StackBackend:
    """The stack, for tests that stop and restart services; skips against an existing cluster."""
    if stack is None:
        pytest.skip("services named by environment cannot be restarted by the tests")
    return stack


@pytest.fixture(scope="session")
def kafka_config(endpoints: Endpoints) -> dict[str, Any]:
    """A confluent-kafka config naming the session's broker."""
    return {"bootstrap.servers": endpoints.bootstrap}


@pytest.fixture(scope="session")
def admin(kafka_config: dict[str, Any], endpoints: Endpoints) -> Admin:
    """An ``Admin`` on the session's services."""
    return Admin(kafka_config, redis_url=endpoints.redis_url)


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> Callable[[str], str]:
    """Makes names unique to this test: ``unique_name("orders")`` -> ``orders-test-x-1a2b3c4d``."""
    test = re.sub(r"[^a-zA-Z0-9]+", "-", request.node.name)[:60].strip("-").lower()

    def make(prefix: str) -> str:
        return f"{prefix}-{test}-{uuid.uuid4().hex[:8]}"

    return make


@pytest.fixture
def topic_factory(admin: Admin, unique_name: Callable[[str], str]) -> Callable[..., str]:
    """Creates a topic with a name unique to this test and returns the name."""

    def create(partitions: int = 1, prefix: str = "t") -> str:
        name = unique_name(prefix)
        admin.create_topic(name, partitions=partitions)
        return name

    return create
