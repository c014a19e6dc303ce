"""The commit point of one partition: the lowest fetched offset not settled (SUB-3, ACK-4).

Pure bookkeeping, used by ``PartitionState``, the pure-Python reference of the compiled core
(``core/src/tracker.rs`` keeps the engine's commit points); ``Partitions.commit_offsets`` commits
what the core says. Nothing below the commit point is unsettled, so a new owner starting there
loses nothing.
"""

from __future__ import annotations

from collections import deque


class OffsetTracker:
    """The lowest fetched offset of a partition that is not settled (the commit point)."""

    def __init__(self) -> None:
        self._order: deque[int] = deque()
        self._settled: set[int] = set()
        self.next_offset: int | None = None

    def add(self, offset: int) -> None:
        """A fetched offset (offsets arrive in increasing order)."""
        self._order.append(offset)
        self.next_offset = offset + 1

    def settle(self, offset: int) -> None:
        """An offset acked or dead-lettered (or skipped as settled before)."""
        self._settled.add(offset)
        order, settled = self._order, self._settled
        while order and order[0] in settled:
            settled.discard(order.popleft())

    def unsettle(self, offset: int) -> None:
        """A settled offset goes out again (a cascade over it, SUB-4): the commit point stays below
        it until it is settled again."""
        self._settled.discard(offset)

    @property
    def watermark(self) -> int | None:
        """The offset to commit: everything below it is settled. None before any fetch."""
        return self._order[0] if self._order else self.next_offset
