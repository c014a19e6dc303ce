"""The durable copy of subscription settings in Kafka (SUB-3, ACK-4): a subscription outlives the loss
of all Redis state, and a deleted one stays deleted."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ordering_layer import Admin, Subscriber
from ordering_layer.config import SUBSCRIPTIONS_TOPIC
from ordering_layer.errors import SubscriptionNotFoundError
from ordering_layer.pytest_plugin import CreatedSubscription
from ordering_layer.state import StateStore
from ordering_layer.state.client import redis_client
from ordering_layer.state.durable import SettingsLog
from tests.checker import wait_until
from tests.integration.conftest import NO_BACKOFF, publish_keys, recording_callback

pytestmark = pytest.mark.integration


def test_a_new_subscriber_resumes_after_redis_lost_the_settings(
        subscription_factory: Callable[..., CreatedSubscription], kafka_config: dict[str, Any],
        endpoints: Any) -> None:
    """SUB-3, ACK-4: after a FLUSHALL took the subscription's settings with every other key, a new
    Subscriber reads them from their durable copy in Kafka and delivers every message, per key in
    order; the settings are back in Redis afterwards."""
    created = subscription_factory(partitions=2, ack_deadline=30.0, retry_policy=NO_BACKOFF)
    checker = publish_keys(kafka_config, created.topic, keys=5, per_key=6)
    redis_client(endpoints.redis_url).flushall()

    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with subscriber.subscribe(created.subscription, recording_callback(checker, "s1"), max_workers=4):
        wait_until(lambda: checker.acked_count() == checker.total(), 60, "every message acked after the flush")
    assert checker.verify() == []
    assert StateStore(endpoints.redis_url).settings(created.subscription) == created.settings


def test_a_deleted_subscription_stays_deleted_after_redis_is_flushed(
        admin: Admin, topic_factory: Callable[..., str], unique_name: Callable[[str], str],
        kafka_config: dict[str, Any], endpoints: Any) -> None:
    """SUB-3: deleting a subscription tombstones its durable copy, so a FLUSHALL does not bring it back:
    neither the admin nor a new Subscriber finds it; the name created again has its new settings."""
    topic, name = topic_factory(partitions=1), unique_name("deleted")
    admin.create_subscription(name, topic=topic)
    admin.delete_subscription(name)
    redis_client(endpoints.redis_url).flushall()

    with pytest.raises(SubscriptionNotFoundError):
        admin.describe_subscription(name)
    with pytest.raises(SubscriptionNotFoundError):
        Subscriber(kafka_config, redis_url=endpoints.redis_url).subscribe(name, lambda message: None)
    assert SettingsLog(kafka_config).read(name) is None

    again = admin.create_subscription(name, topic=topic, ack_deadline=30.0)
    redis_client(endpoints.redis_url).flushall()
    assert StateStore(endpoints.redis_url, kafka_config=kafka_config).settings(name) == again
    admin.delete_subscription(name)


def test_the_durable_copy_is_written_on_creation_and_repaired_by_a_repeated_create(
        admin: Admin, topic_factory: Callable[..., str], unique_name: Callable[[str], str],
        kafka_config: dict[str, Any], endpoints: Any) -> None:
    """SUB-3: ``create_subscription`` writes the settings to the compacted subscriptions topic; settings
    that Redis alone holds (a store without a Kafka config made them) get their copy from a repeated
    ``create_subscription`` with equal settings."""
    topic, name, redis_only = topic_factory(partitions=1), unique_name("copied"), unique_name("redis-only")
    created = admin.create_subscription(name, topic=topic, ack_deadline=20.0)
    log = SettingsLog(kafka_config)
    assert log.read(name) == created
    assert admin.describe_topic(SUBSCRIPTIONS_TOPIC).config["cleanup.policy"] == "compact"

    assert StateStore(endpoints.redis_url).create_subscription(redis_only, created)
    assert log.read(redis_only) is None
    assert admin.create_subscription(redis_only, topic=topic, ack_deadline=20.0) == created
    assert log.read(redis_only) == created
    for each in (name, redis_only):
        admin.delete_subscription(each)
