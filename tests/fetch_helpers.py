"""A subscriber's ``Fetcher`` driven alone, without a coordinator."""

from __future__ import annotations

from collections.abc import Mapping

from confluent_kafka import TopicPartition


class OwnAll:
    """The coordinator's side of rebalances for a fetcher alone: every partition assigned is taken
    at its committed offset, and nothing is committed when it goes."""

    def assigned(self, partitions: list[int], generations: Mapping[int, int]) -> Mapping[int, int]:
        return {}

    def revoking(self, partitions: list[int]) -> list[TopicPartition]:
        return []

    def lost(self, partitions: list[int]) -> None:
        return None
