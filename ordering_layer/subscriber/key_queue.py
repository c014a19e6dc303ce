"""The per-key hold queues of one partition and the backoff of their keys (SUB-1, SUB-2, DLQ-1).

Pure bookkeeping, used by ``PartitionState`` under the engine's lock.

* ``KeyQueue`` holds the fetched records of one ordering key from its first unsettled one. The
  first ``cursor`` records have been delivered since the key's last reset; a nack or expiry of one
  of them rewinds the cursor to it, so it and every later delivered record go out again in order
  (SUB-4), acked ones included.
* ``KeyBackoff`` knows the keys held back after a failure (DLQ-1) and when each hold ends, in a
  due-time heap, so that the keys whose backoff ended are found without a scan while every other
  key goes on (SUB-2).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ordering_layer.subscriber.partition import Record

QueueKey = bytes | int


class KeyQueue:
    """Fetched records of one ordering key (or one unordered record) in offset order.

    Made for nearly every message of a busy subscription (a key's queue goes when it empties), so
    it is a plain slotted class: a dataclass with default factories costs twice as much to make.
    """

    __slots__ = ("acked", "cursor", "failures", "not_before", "outstanding", "records")

    def __init__(self) -> None:
        self.records: deque[Record] = deque()
        self.cursor = 0
        self.outstanding: dict[int, int] = {}
        self.acked: set[int] = set()
        self.failures = 0
        self.not_before = 0.0

    def releasable(self, now: float) -> bool:
        """Nothing outstanding, not backing off, and something not yet delivered."""
        return not self.outstanding and now >= self.not_before and self.cursor < len(self.records)


class KeyBackoff:
    """Keys held back until a due time, with a due-time heap of their holds.

    ``held`` maps each key backing off to the end of its hold; a key held again replaces its earlier
    hold (whose heap entry is then stale and skipped), and a key let go early (``cancel``) is simply
    forgotten.
    """

    __slots__ = ("_heap", "_seq", "held")

    def __init__(self) -> None:
        self.held: dict[QueueKey, float] = {}
        self._heap: list[tuple[float, int, QueueKey]] = []
        self._seq = itertools.count()

    def hold(self, qkey: QueueKey, until: float) -> None:
        """Hold ``qkey`` back until ``until`` (monotonic seconds)."""
        self.held[qkey] = until
        heapq.heappush(self._heap, (until, next(self._seq), qkey))

    def cancel(self, qkey: QueueKey) -> None:
        """Forget the hold of ``qkey``, if any (its key queue went, or it was held with no delay)."""
        self.held.pop(qkey, None)

    def ended(self, now: float) -> list[QueueKey]:
        """The keys whose hold ended by ``now``, in due-time order, no longer held."""
        heap, held = self._heap, self.held
        ended: list[QueueKey] = []
        while heap and heap[0][0] <= now:
            due, _, qkey = heapq.heappop(heap)
            if held.get(qkey) == due:  # else: held again since (a later entry), or let go
                del held[qkey]
                ended.append(qkey)
        return ended

    def next_end(self) -> float | None:
        """The earliest end of a hold (maybe of one replaced since), if any key was held."""
        return self._heap[0][0] if self._heap else None
