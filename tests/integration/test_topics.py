"""``Admin.create_topic`` with ``exist_ok`` called at once by several clients for one new topic (as a
producer's in-process scheduler and its first ``schedule()`` do for the schedule topic): every
caller gets the topic's description, none an error from a broker that does not show it yet."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from ordering_layer import Admin
from ordering_layer.admin import TopicDescription
from ordering_layer.kafka.compacted import CompactedTopic

pytestmark = pytest.mark.integration

CALLERS = 4
ROUNDS = 60


def _race(make: Callable[[], Callable[[], Any]]) -> tuple[list[Any], list[BaseException]]:
    """Run ``CALLERS`` calls released together by a barrier; return their results and errors."""
    calls = [make() for _ in range(CALLERS)]
    barrier = threading.Barrier(CALLERS)
    results: list[Any] = []
    errors: list[BaseException] = []

    def run(call: Callable[[], Any]) -> None:
        barrier.wait(timeout=30)
        try:
            results.append(call())
        except Exception as exc:  # noqa: BLE001 - every error is a finding of the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(call,), daemon=True) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    return results, errors


def test_concurrent_create_with_exist_ok_returns_the_topic_to_every_caller(
        kafka_config: dict[str, Any], unique_name: Callable[[str], str]) -> None:
    for _ in range(ROUNDS):
        name = unique_name("race")

        def make(topic: str = name) -> Callable[[], TopicDescription]:
            admin = Admin(kafka_config)
            return lambda: admin.create_topic(topic, partitions=3, exist_ok=True)

        results, errors = _race(make)
        assert errors == []
        assert len(results) == CALLERS
        assert all(r.name == name and r.partitions == 3 and r.partitions_with_leader == 3 for r in results)


def test_concurrent_compacted_topic_users_all_find_the_topic(
        kafka_config: dict[str, Any], unique_name: Callable[[str], str]) -> None:
    """The schedule, snapshot and settings topics are created on first use by whichever user comes
    first; users racing for it all go on, and the topic is compacted."""
    for _ in range(ROUNDS):
        name = unique_name("compacted-race")

        def make(topic: str = name) -> Callable[[], None]:
            return CompactedTopic(kafka_config, topic, "schedule").ensure_topic

        _, errors = _race(make)
        assert errors == []
        assert Admin(kafka_config).describe_topic(name).config["cleanup.policy"] == "compact"
