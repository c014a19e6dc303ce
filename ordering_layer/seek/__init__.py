"""Snapshots of a subscription's acked state and seeks to a time or a snapshot (GRP-3)."""

from ordering_layer.seek.runner import PartitionSeek, SeekResult
from ordering_layer.seek.snapshots import Snapshot, SnapshotPartition
from ordering_layer.seek.targets import SeekTarget

__all__ = ["PartitionSeek", "SeekResult", "SeekTarget", "Snapshot", "SnapshotPartition"]
