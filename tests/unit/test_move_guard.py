"""The move guard's check (SUB-8): each hold is answered for its own count and old partitions."""

from __future__ import annotations

from typing import Any

from ordering_layer.kafka.partitioner import partition_for
from ordering_layer.state.counts import History
from ordering_layer.subscriber.moves import MoveGuard
from ordering_layer.subscriber.requests import MovesCleared

HISTORY: History = [(12, 0), (18, 1_000), (24, 2_000)]


class OldRecords:
    """The old partitions as ``OldPartitions`` answers for them: per partition, the key's unsettled
    records with the count each was published under."""

    def __init__(self, unsettled: dict[int, dict[bytes, list[int]]]) -> None:
        self._unsettled = unsettled

    def refresh(self, partitions: set[int], history: History) -> None:
        pass

    def unsettled(self, partition: int, keys: dict[bytes, int]) -> set[bytes]:
        records = self._unsettled.get(partition, {})
        return {key for key, below in keys.items() if any(count < below for count in records.get(key, []))}

    def pending(self, partition: int) -> bool:
        return False

    def forget(self) -> None:
        pass


def guard_with(old: OldRecords, held: dict[tuple[int, int], dict[bytes, int]]) -> tuple[MoveGuard, list[Any]]:
    posted: list[Any] = []
    guard = MoveGuard({"bootstrap.servers": "127.0.0.1:1"}, Any, "sub", "topic", posted.append)  # type: ignore[arg-type]
    guard.history = HISTORY
    guard._old = old  # type: ignore[assignment]
    guard._held = held
    guard._mark = lambda cleared, partition, history: True  # type: ignore[method-assign]
    return guard, posted


def away_and_back() -> bytes:
    """A key in partition 4 under 12 and 24 partitions, and in 16 under 18."""
    return next(key for key in (f"key-{n}".encode() for n in range(100_000))
                if (partition_for(key, 12), partition_for(key, 18), partition_for(key, 24)) == (4, 16, 4))


def test_a_key_held_in_two_partitions_is_cleared_where_it_waits_for_nothing() -> None:
    """SUB-8: a key that moved away and back (4 -> 16 -> 4) is held in 16 (its 18-count records wait
    for its 12-count ones in 4, all settled) and in 4 (its 24-count records wait for its 18-count
    ones in 16, unsettled: held). The hold in 16 is cleared; the one in 4 waits. Answered per key
    alone, the key looked held in both and neither went on."""
    key = away_and_back()
    old = OldRecords({16: {key: [18]}, 4: {key: [24]}})
    guard, posted = guard_with(old, {(16, 7): {key: 18}, (4, 9): {key: 24}})
    guard._check()
    assert posted == [MovesCleared(16, 7, [key])]
    assert guard._held == {(16, 7): {}, (4, 9): {key: 24}}
