"""Session-wide real services: one Kafka broker and one Redis per test session.

They come from the project's public pytest plugin (``ordering_layer.pytest_plugin``, registered by
the package's ``pytest11`` entry point): by default the project's own launcher starts them
(``ORDERING_LAYER_STACK=local`` processes, or ``testcontainers`` containers). Name an existing
cluster instead with ``ORDERING_LAYER_BOOTSTRAP`` and ``ORDERING_LAYER_REDIS_URL``; tests that
restart services are then skipped. Tests are isolated by unique topic names.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from ordering_layer import Admin
from ordering_layer.pytest_plugin import unique_test_name
from ordering_layer.stack import Endpoints, StackBackend

pytest_plugins = ["tests.tracing_fixtures"]  # ``exporter`` and ``provider`` for the tracing tests


@pytest.fixture(scope="session")
def stack(ordering_layer_stack: StackBackend | None) -> StackBackend | None:
    """The session's stack backend (the plugin's), or None when a cluster is named by environment."""
    return ordering_layer_stack


@pytest.fixture(scope="session")
def endpoints(ordering_layer_endpoints: Endpoints) -> Endpoints:
    """Bootstrap servers and Redis URL of the session's services."""
    return ordering_layer_endpoints


@pytest.fixture
def restartable(stack: StackBackend | None) -> StackBackend:
    """The stack, for tests that stop and restart services; skips against an existing cluster."""
    if stack is None:
        pytest.skip("services named by environment cannot be restarted by the tests")
    return stack


@pytest.fixture(scope="session")
def admin(ordering_layer_admin: Admin) -> Admin:
    """An ``Admin`` on the session's services."""
    return ordering_layer_admin


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> Callable[[str], str]:
    """Makes names unique to this test: ``unique_name("orders")`` -> ``orders-test-x-1a2b3c4d``."""

    def make(prefix: str) -> str:
        return unique_test_name(request, prefix)

    return make


@pytest.fixture
def topic_factory(admin: Admin, unique_name: Callable[[str], str]) -> Callable[..., str]:
    """Creates a topic with a name unique to this test and returns the name."""

    def create(partitions: int = 1, prefix: str = "t") -> str:
        name = unique_name(prefix)
        admin.create_topic(name, partitions=partitions)
        return name

    return create


class _ConfigWarnings(logging.Handler):
    """Keeps librdkafka's CONFWARN logs: a Kafka client was handed a setting it does not take."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "CONFWARN" in message:
            self.seen.append(f"{record.name}: {message}")


@pytest.fixture(autouse=True)
def no_config_warnings() -> Iterator[None]:
    """DRP-2: no Kafka client of the layer (they all log through Python's logging) warns about its
    settings in any test: internal clients get only the settings that apply to them."""
    handler = _ConfigWarnings()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
    assert not handler.seen, f"librdkafka warned about settings: {handler.seen}"


_EXIT_STATUS = pytest.StashKey[int]()
_STDERR = pytest.StashKey[int]()

# How long a test may outlive pytest-timeout's limit. pytest-timeout interrupts a test from a signal
# handler, which runs only when the main thread gets back to Python: a test stuck in native code
# that never returns, or behind a thread that holds the GIL for good, would run into CI's own limit
# with nothing said. Past this grace every thread's stack is printed and the process ends, failed.
STUCK_GRACE = 300.0


def pytest_configure(config: pytest.Config) -> None:
    # The real stderr, kept before a test's output capture takes file descriptor 2.
    config.stash[_STDERR] = os.dup(2)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    marker = item.get_closest_marker("timeout")  # pytest-timeout's own: timeout(N) or timeout(timeout=N)
    given = (marker.kwargs.get("timeout", marker.args[0] if marker.args else None)) if marker is not None else None
    limit = float(given if given is not None else item.config.getini("timeout") or 0)
    watched = limit > 0 and not float(item.config.getini("faulthandler_timeout") or 0)
    if watched:
        faulthandler.dump_traceback_later(limit + STUCK_GRACE, exit=True, file=item.config.stash[_STDERR])
    try:
        yield
    finally:
        if watched:
            faulthandler.cancel_dump_traceback_later()

# How long the test process may take to exit once the session is over. A thread a test left running
# (a non-daemon thread, or a Kafka client blocked on services the session has stopped) would keep it
# alive until CI's own limit; instead every thread's stack is printed and the process ends, failed.
EXIT_GRACE = 180.0


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


def pytest_unconfigure(config: pytest.Config) -> None:
    status = config.stash.get(_EXIT_STATUS, 1)

    def guard() -> None:
        time.sleep(EXIT_GRACE)  # a daemon thread: a process that exits in time ends it here
        print(f"\nthe test process did not exit {EXIT_GRACE:.0f} s after the session ended; its threads:",
              file=sys.__stderr__, flush=True)
        faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        os._exit(status or 1)

    threading.Thread(target=guard, name="exit-guard", daemon=True).start()
