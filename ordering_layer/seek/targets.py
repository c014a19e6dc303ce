"""Where a seek sends each partition (GRP-3), and the acked state a snapshot keeps: pure logic.

A seek target is an offset to restart from plus the offsets above it that count as acked. Seeking
to a time marks every message before it acked and every later one unacked: the target is the first
offset at or after the time, nothing settled above it; a time past the last message purges the
backlog (the target is the log end). Seeking to a snapshot restores its committed offset and its
settled set; partitions added to the topic since the snapshot restart at their start (all their
messages were published after it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ordering_layer.seek.snapshots import Snapshot, SnapshotPartition


@dataclass(frozen=True)
class SeekTarget:
    """A partition restarts at ``offset``; the ``settled`` offsets above it count as acked."""

    partition: int
    offset: int
    settled: tuple[int, ...] = ()


def time_targets(found: Mapping[int, int], ends: Mapping[int, int]) -> list[SeekTarget]:
    """Targets of a seek to a time.

    Args:
        found: per partition the first offset whose timestamp is at or after the time, as Kafka's
            ``offsets_for_times`` answers it (negative: no such message).
        ends: per partition the log end offset.
    """
    return [SeekTarget(p, offset if offset >= 0 else ends[p]) for p, offset in sorted(found.items())]


def snapshot_targets(snapshot: Snapshot, starts: Mapping[int, int]) -> list[SeekTarget]:
    """Targets of a seek to ``snapshot`` for the topic's partitions now (``starts``: partition ->
    the log start offset)."""
    kept = {p.partition: p for p in snapshot.partitions}
    targets = []
    for partition, start in sorted(starts.items()):
        state = kept.get(partition)
        if state is None:
            targets.append(SeekTarget(partition, start))
        else:
            settled = tuple(o for o in state.settled if o >= state.committed)
            targets.append(SeekTarget(partition, state.committed, settled))
    return targets


def snapshot_state(committed: Mapping[int, int], settled: Mapping[int, Sequence[int]]) -> tuple[SnapshotPartition, ...]:
    """Per partition the committed offset and the settled offsets at or above it (ascending, deduplicated;
    the committed offset lags the acks by up to a commit interval, so it may be settled itself)."""
    return tuple(SnapshotPartition(p, c, tuple(sorted({o for o in settled.get(p, ()) if o >= c})))
                 for p, c in sorted(committed.items()))
