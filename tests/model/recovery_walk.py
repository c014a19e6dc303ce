"""The recovery walk of a claimed partition (SUB-3, SUB-4): the pure-Python reference of the walk in
``core/src/partition.rs``, used by ``partition.PartitionState``.

After a claim, records settled before (by an earlier owner) are skipped, unless their key cascades:
a key cascades from its first record in the walk that is not settled, or from a mark an earlier
owner left. A settled record that goes out again in a cascade is unsettled in Redis first
(``UNSETTLED``). Nothing is released until every record up to the highest offset settled before
(the horizon) has been taken, so that the flush of a cascade's first release carries the
unsettling of the key's later records; when the walk is ended early (``end_walk``: the fetch is held
over a buffer limit), each cascading ordering key is marked in Redis by the offset it cascades from
(``CASCADE_FROM``, before anything is released) and the commit point is held at the lowest mark
(``hold``), so that a successor after a crash cascades the same keys; the marks are dropped
(``CASCADE_DONE``) when a walk ends.
"""

from __future__ import annotations

from collections.abc import Hashable

__all__ = ["RecoveryWalk"]


class RecoveryWalk:
    """The walk of one claimed partition.

    Args:
        settled_before: offsets settled above the committed offset, read at claim.
        cascades: the marks of an earlier owner whose walk was ended early.
        ops: where the walk's ops go, in decision order, shared with the partition's rewinds:
            ("u", offset) ``UNSETTLED``, ("c", offset) ``CASCADE_FROM``, ("x", offset) ``CASCADE_DONE``.
    """

    def __init__(self, settled_before: frozenset[int], cascades: frozenset[int], ops: list[tuple[str, int]]) -> None:
        self._settled_before = set(settled_before)
        self._horizon = max(settled_before | cascades, default=-1)
        self._cascading: dict[Hashable, int] = {}  # cascading key -> the offset it cascades from
        # Marks in Redis or queued for it: the claim's, whose records cascade their keys when taken
        # (an own mark's record was taken already: offsets are taken once), and own.
        self._marks = set(cascades)
        self._holds = True
        self._ops = ops

    def take(self, offset: int, qkey: Hashable) -> bool:
        """A fetched record of queue key ``qkey``; False when it is to be skipped (settled before,
        its key not cascading). Ends the walk at the horizon."""
        horizon = self._horizon
        if horizon < 0:
            return True
        if offset > horizon:
            self._end()
            return True
        settled = offset in self._settled_before
        cascades = qkey in self._cascading
        skipped = settled and not cascades and offset not in self._marks
        if not skipped:
            if settled:
                self._ops.append(("u", offset))
            # A record that queues alone (its queue key is its offset) has nothing to cascade over.
            if not cascades and not isinstance(qkey, int):
                self._cascading[qkey] = offset
                if not self._holds:
                    self._mark(offset)
        if offset == horizon:
            self._end()
        return not skipped

    def passed(self, offset: int) -> None:
        """A record below the claim's floor was skipped (settled before, cascading nothing): the walk
        ends when it reaches the horizon."""
        if 0 <= self._horizon <= offset:
            self._end()

    @property
    def holding(self) -> bool:
        """Releases are held: the walk has not taken every record settled before yet."""
        return self._horizon >= 0 and self._holds

    def end_early(self) -> None:
        """Release during the walk from now on; the keys found cascading so far are marked, lowest
        offset first."""
        if not self._holds:
            return
        self._holds = False
        if self._horizon >= 0:
            for offset in sorted(self._cascading.values()):
                self._mark(offset)

    def hold(self, watermark: int | None) -> int | None:
        """The commit point ``watermark`` held at the lowest mark."""
        if watermark is None or not self._marks:
            return watermark
        return min(watermark, min(self._marks))

    def _mark(self, offset: int) -> None:
        if offset not in self._marks:
            self._marks.add(offset)
            self._ops.append(("c", offset))

    def _end(self) -> None:
        self._horizon = -1
        self._settled_before.clear()
        self._cascading.clear()
        self._ops.extend(("x", mark) for mark in sorted(self._marks))
        self._marks.clear()
