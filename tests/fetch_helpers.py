"""A subscriber's ``Fetcher`` driven alone, without a coordinator."""

from __future__ import annotations

import functools
from collections.abc import Mapping

import confluent_kafka
import pytest
from confluent_kafka import TopicPartition

from ordering_layer.subscriber import native_fetch


class OwnAll:
    """The coordinator's side of rebalances for a fetcher alone: every partition assigned is taken
    at its committed offset, and nothing is committed when it goes."""

    def assigned(self, partitions: list[int], generations: Mapping[int, int]) -> Mapping[int, int]:
        return {}

    def revoking(self, partitions: list[int]) -> list[TopicPartition]:
        return []

    def lost(self, partitions: list[int]) -> None:
        return None


def report_release(monkeypatch: pytest.MonkeyPatch, confluent_kafka_version: str | tuple[str, int] | None = None,
                   librdkafka_version: str | None = None) -> None:
    """Until the test ends, confluent-kafka reports these releases (the loaded ones where None), and
    the native fetch checks them afresh (its once-per-process answer is set aside meanwhile)."""
    if confluent_kafka_version is not None:
        monkeypatch.setattr(confluent_kafka, "version", lambda: confluent_kafka_version)
    if librdkafka_version is not None:
        monkeypatch.setattr(confluent_kafka, "libversion", lambda: (librdkafka_version, 0))
    monkeypatch.setattr(native_fetch, "unknown_release", functools.cache(native_fetch.unknown_release.__wrapped__))
