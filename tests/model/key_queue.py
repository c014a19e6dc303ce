"""The per-key hold queues of one partition, the backoff of their keys and the quarantine of suspects
(SUB-1, SUB-2, DLQ-1, DLQ-3).

Pure bookkeeping, used by ``PartitionState``, the pure-Python reference of the compiled core
(``core/src/key_queue.rs`` is what the engine runs); its records and deliveries are the engine's
(``ordering_layer.subscriber.records``).

* ``KeyQueue`` holds the fetched records of one ordering key from its first unsettled one. The
  first ``cursor`` records have been delivered since the key's last reset; a nack or expiry of one
  of them rewinds the cursor to it, so it and every later delivered record go out again in order
  (SUB-4), acked ones included.
* ``KeyBackoff`` knows the keys held back after a failure (DLQ-1) and when each hold ends, in a
  due-time heap, so that the keys whose backoff ended are found without a scan while every other
  key goes on (SUB-2).
* ``Quarantine`` lets the quarantined suspects of a partition (records earlier owners handed out
  and never settled, charged ``QUARANTINE_FROM`` attempts or more, ACK-6; callback mode only) go
  out one at a time, so that a poison's crashes charge no innocent up to the dead-letter limit
  (DLQ-3).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from ordering_layer.subscriber.records import Delivery, QueueKey, Record

__all__ = ["QUARANTINE_FROM", "Delivery", "KeyBackoff", "KeyQueue", "Quarantine", "QueueKey", "Record"]

# Suspects charged this many attempts or more go out one at a time. One crash charges what was out
# one attempt: those suspects go out together, so that the next owner recovers from a single crash
# at full speed. A poison crashes that owner too, which charges whatever ran beside it a second
# attempt; from then on each goes out alone, so an innocent is charged for two crashes at most,
# below any dead-letter limit (5 at least), and the poison for every crash.
QUARANTINE_FROM = 2


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


class Quarantine:
    """At most one quarantined suspect of a partition outstanding at a time (ACK-6, DLQ-3).

    A suspect may be what crashed the partition's earlier owner. Run beside other messages, a poison
    would crash them again and again, each crash charging them an attempt, until they were
    dead-lettered with it; run alone, its crashes charge only itself. So a key whose next record is
    quarantined waits (``waiting``, oldest first) while another quarantined record of the partition
    is outstanding (``offset``); once that one is settled in any way (ack, nack, lapse, dead letter,
    given back), the oldest waiting key is ready again. Suspects of a single crash are not
    quarantined (``QUARANTINE_FROM``): a message that ran beside the poison in two crashes is charged
    for both, then waits its turn. Other records are not held (SUB-2).
    """

    __slots__ = ("offset", "waiting")

    def __init__(self) -> None:
        self.offset: int | None = None
        self.waiting: dict[QueueKey, None] = {}

    def admit(self, qkey: QueueKey, offset: int) -> bool:
        """Whether the suspect ``offset``, next of ``qkey``, may go out now; if not, ``qkey`` waits."""
        if self.offset is not None:
            self.waiting[qkey] = None
            return False
        self.offset = offset
        self.waiting.pop(qkey, None)
        return True

    def settled(self, ready: dict[QueueKey, None]) -> None:
        """The outstanding suspect is settled or given back: the oldest waiting key joins ``ready``."""
        self.offset = None
        waiting = self.waiting
        if waiting:
            qkey = next(iter(waiting))
            del waiting[qkey]
            ready[qkey] = None
