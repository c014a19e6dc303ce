"""The public pytest plugin, used the way a user's project uses it.

A separate test module that knows nothing of this repository's conftest (it only asks for the
plugin's fixtures) runs in its own pytest process, in a folder of its own. The plugin reaches it
through the package's ``pytest11`` entry point, not through ``-p``.
"""

from __future__ import annotations

import pytest

from ordering_layer.stack import Endpoints

pytestmark = pytest.mark.integration

pytest_plugins = ["pytester"]

USER_TEST_MODULE = '''
"""A user's test: publish with ordering keys, consume with the ordered subscriber."""
import threading

from ordering_layer import OrderedProducer, Subscriber


def test_orders_arrive_in_key_order(kafka_bootstrap, redis_url, kafka_config, subscription_factory):
    assert kafka_config == {"bootstrap.servers": kafka_bootstrap}
    created = subscription_factory(partitions=3, ack_deadline=20.0)
    assert created.settings.enable_message_ordering
    with OrderedProducer(kafka_config) as producer:
        futures = [producer.publish(created.topic, f"{key}:{i}".encode(), ordering_key=f"customer-{key}")
                   for i in range(20) for key in range(5)]
        assert all(f.result(30).offset >= 0 for f in futures)
    seen: dict[str, list[int]] = {}
    done = threading.Event()
    lock = threading.Lock()

    def callback(message):
        with lock:
            seen.setdefault(message.ordering_key, []).append(int(message.data.split(b":")[1]))
            if sum(map(len, seen.values())) == 100:
                done.set()
        message.ack()

    with Subscriber(kafka_config, redis_url=redis_url).subscribe(created.subscription, callback):
        assert done.wait(60), seen
    assert seen == {f"customer-{key}": list(range(20)) for key in range(5)}


def test_factory_names_are_unique(subscription_factory):
    first, second = subscription_factory(), subscription_factory()
    assert len({first.topic, second.topic, first.subscription, second.subscription}) == 4
'''


def test_user_project_uses_the_plugin_fixtures(pytester: pytest.Pytester, endpoints: Endpoints,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin's fixtures give a user's test module a real broker, Redis and subscriptions.

    The user's run is pointed at this session's services by environment, the way a user points
    the plugin at an existing cluster (starting a second stack would only repeat the session's).
    """
    monkeypatch.setenv("ORDERING_LAYER_BOOTSTRAP", endpoints.bootstrap)
    monkeypatch.setenv("ORDERING_LAYER_REDIS_URL", endpoints.redis_url)
    pytester.makepyfile(test_user_project=USER_TEST_MODULE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v", timeout=300)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_orders_arrive_in_key_order PASSED*"])


def test_user_project_gets_its_own_stack_from_the_plugin(pytester: pytest.Pytester,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """With no cluster named, the plugin starts one Kafka and one Redis for the user's session with
    the backend ``ORDERING_LAYER_STACK`` names (local processes, or containers), and removes them."""
    monkeypatch.delenv("ORDERING_LAYER_BOOTSTRAP", raising=False)
    monkeypatch.delenv("ORDERING_LAYER_REDIS_URL", raising=False)
    pytester.makepyfile(test_user_project=USER_TEST_MODULE + '''

def test_the_session_stack_is_the_named_backend(ordering_layer_stack):
    import os
    assert type(ordering_layer_stack).__name__ == {
        "local": "LocalStack", "testcontainers": "ContainerStack"}[os.environ.get("ORDERING_LAYER_STACK", "local")]
    assert ordering_layer_stack.status()["up"]
''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v", timeout=600)
    result.assert_outcomes(passed=3)
