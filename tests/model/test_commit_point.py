"""The commit point of a partition (``OffsetTracker``)."""

from __future__ import annotations

from tests.model.commit_point import OffsetTracker


def test_offset_tracker_commits_lowest_unsettled() -> None:
    """ACK-4: the committed offset is the lowest fetched offset not yet settled."""
    tracker = OffsetTracker()
    assert tracker.watermark is None
    for offset in (5, 6, 7, 9):
        tracker.add(offset)
    assert tracker.watermark == 5
    tracker.settle(6)
    tracker.settle(9)
    assert tracker.watermark == 5
    tracker.settle(5)
    assert tracker.watermark == 7
    tracker.settle(7)
    assert tracker.watermark == 10


def test_a_start_offset_is_the_commit_point_until_records_arrive() -> None:
    """SUB-3, GRP-3: a tracker started at an offset (a seek's target) commits it while nothing is fetched,
    and the first fetched offset once one is."""
    tracker = OffsetTracker()
    tracker.next_offset = 40
    assert tracker.watermark == 40
    tracker.add(42)
    assert tracker.watermark == 42
    tracker.settle(42)
    assert tracker.watermark == 43


def test_offsets_skipped_as_settled_before_move_the_commit_point_in_order() -> None:
    """SUB-3: settling out of order never moves the commit point past an unsettled offset."""
    tracker = OffsetTracker()
    for offset in range(5):
        tracker.add(offset)
    for offset in (4, 2, 3):
        tracker.settle(offset)
    assert tracker.watermark == 0
    tracker.settle(0)
    assert tracker.watermark == 1
    tracker.settle(1)
    assert tracker.watermark == 5
