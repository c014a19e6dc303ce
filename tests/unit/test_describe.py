"""Unit tests of ``subscription describe``'s offset arithmetic and table (no Kafka, no Redis)."""

from __future__ import annotations

from ordering_layer.config import DeadLetterPolicy, SubscriptionSettings
from ordering_layer.describe import PartitionDescription, SubscriptionDescription, _first_unsettled, _RedisState
from ordering_layer.describe_table import COLUMNS, render_description
from ordering_layer.kafka.offsets import PartitionOffsets


def test_backlog_counts_from_committed_or_log_start() -> None:
    """ACK-4: backlog is log end minus committed offset; never committed counts from the log start."""
    assert PartitionOffsets(0, 7, 0, 10).backlog == 3
    assert PartitionOffsets(0, None, 4, 10).backlog == 6
    assert PartitionOffsets(0, 2, 5, 10).backlog == 5  # committed offset deleted by retention


def test_first_unsettled_skips_settled_offsets_above_the_commit() -> None:
    """ACK-4: acks above the committed offset live in Redis (the floor, and the settled offsets above
    it); the oldest unacked is the first gap."""
    assert _first_unsettled(PartitionOffsets(0, 5, 0, 20), _RedisState(1, {5, 6, 8}, set())) == 7
    assert _first_unsettled(PartitionOffsets(0, None, 3, 20), _RedisState(1, set(), set())) == 3
    assert _first_unsettled(PartitionOffsets(0, 5, 0, 20), _RedisState(1, {9, 11}, set(), floor=9)) == 10


def row(partition: int, **changes: object) -> PartitionDescription:
    values: dict[str, object] = dict(
        partition=partition, owner="rdkafka", owner_host="/10.0.0.1", owner_member_id="m-1", epoch=3,
        committed=10, log_end=15, backlog=5, outstanding=2, oldest_unacked_age=3.25, held_keys=2,
        held_keys_complete=True, parked_keys=0)
    values.update(changes)
    return PartitionDescription(**values)  # type: ignore[arg-type]


def test_table_has_one_aligned_row_per_partition() -> None:
    """The table names the subscription, totals and parked keys, then one row per partition."""
    described = SubscriptionDescription(
        "sub", SubscriptionSettings(topic="orders", dead_letter_policy=DeadLetterPolicy("dlq", mode="park_key")),
        "STABLE", (row(0), row(1, owner=None, owner_host=None, epoch=None, committed=None, oldest_unacked_age=None,
                                held_keys=7, held_keys_complete=False, parked_keys=1, pending_seek=4,
                                moved_keys_held=3)),
        ("poison",))
    text = render_description(described)
    lines = text.splitlines()
    assert lines[0] == "subscription sub  topic orders  group STABLE"
    assert "(park_key)" in lines[1]
    assert lines[2] == "backlog 10  outstanding 4  parked keys 1 (poison)"
    table = lines[4:]
    assert table[0].split("  ")[0] == COLUMNS[0]
    assert table[1].split() == ["0", "rdkafka@10.0.0.1", "3", "10", "15", "5", "2", "3.2s", "2", "0", "0", "-"]
    assert table[2].split() == ["1", "-", "-", "-", "15", "5", "2", "-", ">=7", "1", "3", "pending", "#4"]
    end_of_column = table[0].index("log end") + len("log end")
    assert table[1].index(" 15 ") + 3 == end_of_column == table[2].index(" 15 ") + 3  # numbers right-aligned
    assert described.to_json()["partitions"][1]["held_keys_complete"] is False
    assert described.to_json()["partitions"][1]["pending_seek"] == 4
    assert described.to_json()["partitions"][1]["moved_keys_held"] == 3
