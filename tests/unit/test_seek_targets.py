"""GRP-3 pure parts: seek targets, snapshot records and expiry, commit tags, result counts, CLI parsing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import click
import pytest

from ordering_layer.cli.seek import parse_time, snapshot_rows, summary
from ordering_layer.errors import ConfigError, RecordFormatError
from ordering_layer.kafka.offsets import seek_tag, tagged_generation
from ordering_layer.seek.runner import PartitionSeek, SeekResult
from ordering_layer.seek.snapshots import Snapshot, SnapshotPartition, check_name, live_snapshots
from ordering_layer.seek.targets import SeekTarget, snapshot_state, snapshot_targets, time_targets


def _snapshot(name: str = "s", expire_at_ms: int = 2_000, partitions: tuple[SnapshotPartition, ...] = ()) -> Snapshot:
    return Snapshot(name, "sub", "orders", 1_000, expire_at_ms, partitions)


def test_time_targets_use_the_first_offset_at_the_time_and_the_log_end_past_the_last_message() -> None:
    """GRP-3: before the time acked, after it unacked; a time past every message purges (log end)."""
    assert time_targets({0: 5, 1: -1, 2: 0}, {0: 9, 1: 7, 2: 3}) == [
        SeekTarget(0, 5), SeekTarget(1, 7), SeekTarget(2, 0)]


def test_snapshot_targets_restore_committed_and_settled_and_start_new_partitions_at_their_start() -> None:
    """GRP-3: a snapshot's partitions get their committed offset and settled set back; a partition
    added since restarts at its log start (all its messages came after the snapshot)."""
    snapshot = _snapshot(partitions=(SnapshotPartition(0, 4, (4, 6, 9)), SnapshotPartition(1, 2, ())))
    assert snapshot_targets(snapshot, {0: 0, 1: 0, 2: 3}) == [
        SeekTarget(0, 4, (4, 6, 9)), SeekTarget(1, 2), SeekTarget(2, 3)]


def test_snapshot_state_keeps_settled_offsets_at_or_above_the_committed_one() -> None:
    """GRP-3: offsets settled below the committed offset are implied by it; the committed offset itself
    may be settled (commits lag the acks) and is kept."""
    state = snapshot_state({1: 10, 0: 3}, {0: [5, 1, 3, 5], 1: []})
    assert state == (SnapshotPartition(0, 3, (3, 5)), SnapshotPartition(1, 10, ()))


def test_snapshot_record_round_trip_and_refusal() -> None:
    """GRP-3: the snapshot record (schemas/snapshot.avsc) decodes to what was encoded."""
    snapshot = _snapshot(partitions=(SnapshotPartition(0, 4, (5, 7)), SnapshotPartition(1, 0)))
    assert Snapshot.decode(snapshot.encode()) == snapshot
    assert snapshot.settled_above == 2
    assert snapshot.created_at == datetime.fromtimestamp(1, UTC)
    with pytest.raises(RecordFormatError):
        Snapshot.decode(b"\x01\x02")


def test_expired_snapshots_are_set_apart_and_bad_records_skipped() -> None:
    """GRP-3: a snapshot is live until its expiry; then it is to be forgotten."""
    live, expired = live_snapshots({"old": _snapshot("old", 1_500).encode(), "new": _snapshot("new", 3_000).encode(),
                                    "junk": b"\xff"}, at_ms=1_500)
    assert list(live) == ["new"] and expired == ["old"]
    assert not _snapshot(expire_at_ms=1_501).expired(1_500)


@pytest.mark.parametrize("name", ["", "x" * 256, "tab\there"])
def test_bad_snapshot_names_are_refused(name: str) -> None:
    """GRP-3: a snapshot name is 1..255 bytes of printable text."""
    with pytest.raises(ConfigError):
        check_name(name)


def test_commit_tags_carry_the_seek_generation() -> None:
    """GRP-3: commit metadata names the seek generation; anything else carries none."""
    assert tagged_generation(seek_tag(12)) == 12
    assert tagged_generation("") is None
    assert tagged_generation(None) is None
    assert tagged_generation("ol-seek:x") is None
    assert tagged_generation("user metadata") is None


def test_seek_result_counts_and_summary() -> None:
    """GRP-3: the result counts who applied the seek and how far partitions moved."""
    result = SeekResult("sub", 3, (PartitionSeek(0, 10, 4, 2, by_admin=False), PartitionSeek(1, 5, 8, 0, by_admin=True),
                                   PartitionSeek(2, None, 0, 0, by_admin=False)))
    assert (result.applied_by_subscribers, result.applied_by_admin, result.rewound, result.skipped) == (2, 1, 6, 3)
    assert summary(result) == ("seek 3 of sub applied by 3 of 3 partitions (2 by subscribers, 1 by the admin); "
                               "rewound 6 offsets, skipped 3")


def test_cli_time_is_iso_8601_and_utc_without_a_zone() -> None:
    """GRP-3: ``--time`` takes ISO 8601; a time without a zone is UTC."""
    assert parse_time("2024-05-01T10:00:00") == datetime(2024, 5, 1, 10, tzinfo=UTC)
    assert parse_time("2024-05-01T10:00:00+02:00") == datetime(2024, 5, 1, 10, tzinfo=timezone(timedelta(hours=2)))
    with pytest.raises(click.BadParameter):
        parse_time("yesterday")
    assert snapshot_rows([_snapshot(partitions=(SnapshotPartition(0, 1, (3,)),))]) == [
        ["s", "sub", "orders", "1970-01-01T00:00:01+00:00", "1970-01-01T00:00:02+00:00", "1", "1"]]
