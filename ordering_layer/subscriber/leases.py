"""Leases of outstanding deliveries: deadlines, p99 extension, lapses (ACK-1, ACK-2, ACK-3).

``Leases`` knows every delivery handed out and not yet settled; each ``Delivery`` carries its own
lease (deadline, first delivery, next check), so no object is made per lease. A due-time heap
holds one ``Watch`` per released batch (the deliveries of one release share their deadline), and
one entry per lease watched alone since (a new deadline, an extension); shortly before a deadline
the lease is extended by the p99 ack latency (``Histogram``), clamped, unless it has been held for
``max_lease_duration``; at the deadline it lapses and the coordinator gives the delivery back
(SUB-4). Pure bookkeeping: the coordinator writes what it returns to Redis.

A batch's watch holds no object per delivery: it counts those it still looks at (``live``), keeps
their offsets as machine integers (an ``array``, which the garbage collector does not walk), and
the deliveries refer to it. A watch stays in the heap for the ack deadline, long after its
deliveries are usually settled, so it must keep nothing alive that the collector would walk
(``bench/RESULTS.md``: such keys cost a busy subscriber most of its lease tracking). A watch that
comes due with live deliveries looks its own offsets up, nothing else.

With ``track=False`` (a comparison setting, not for production) no deadline is watched: leases
neither lapse nor get extended, and ``admit`` asks for no lease write.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from array import array
from collections import deque
from collections.abc import Sequence

from ordering_layer.config import SubscriptionSettings
from ordering_layer.subscriber.histogram import Histogram, extension_seconds
from ordering_layer.subscriber.partition import Delivery

OutKey = tuple[int, int]  # (partition, offset)
_OBSERVATIONS_KEPT = 100_000  # ack latencies kept for a metrics reader that does not come


class Watch:
    """The lease watch of one released batch of a partition: when it looks (``check``), the batch's
    offsets and how many of its deliveries it still looks at (``live``: those outstanding and not
    watched alone since)."""

    __slots__ = ("check", "live", "offsets", "partition")

    def __init__(self, partition: int, check: float, offsets: array[int]) -> None:
        self.partition, self.check, self.offsets, self.live = partition, check, offsets, len(offsets)


class Extension:
    """A lease extended to ``wall_ms`` (epoch ms) for Redis."""

    __slots__ = ("offset", "partition", "wall_ms")

    def __init__(self, partition: int, offset: int, wall_ms: int) -> None:
        self.partition, self.offset, self.wall_ms = partition, offset, wall_ms


def _unwatch(out: Delivery) -> None:
    """The delivery's batch watch no longer looks at it (settled, or watched alone)."""
    watch = out.watch
    if watch is not None:
        watch.live -= 1
        out.watch = None


def lease_margin(ack_deadline: float) -> float:
    """How long before a deadline the lease is extended."""
    return min(2.0, ack_deadline / 5)


def wall_ms(seconds: float) -> int:
    """Epoch milliseconds ``seconds`` from now (what Redis stores as a deadline)."""
    return int((time.time() + seconds) * 1000)


class Leases:
    """Outstanding deliveries and their deadlines, for one engine (coordinator thread only).

    Args:
        settings: the subscription's ack deadline, lease bounds and maximum lease duration.
        track: watch deadlines (the default); False turns leases off for comparisons.
    """

    def __init__(self, settings: SubscriptionSettings, *, track: bool = True) -> None:
        self.settings = settings
        self.track = track
        self.outstanding: dict[OutKey, Delivery] = {}
        self.bytes = 0
        self.histogram = Histogram()
        self.extensions = 0
        self.lapses = 0
        self.latencies: deque[float] = deque(maxlen=_OBSERVATIONS_KEPT)  # drained by metrics
        self._pending_latencies: list[float] = []
        self._heap: list[tuple[float, int, Watch | OutKey]] = []  # a batch's watch, or one lease's key
        self._seq = itertools.count()

    def admit(self, partition: int, batch: Sequence[Delivery], now: float) -> int:
        """Take released deliveries as outstanding, watched together. Returns their payload bytes."""
        deadline = now + self.settings.ack_deadline
        outstanding = self.outstanding
        check, watch = 0.0, None
        if self.track:
            check = self._check_time(deadline)
            watch = Watch(partition, check, array("q", [delivery.record.offset for delivery in batch]))
            heapq.heappush(self._heap, (check, next(self._seq), watch))
        size = 0
        for delivery in batch:
            record = delivery.record
            delivery.deadline, delivery.first_delivery, delivery.check, delivery.watch = deadline, now, check, watch
            outstanding[(partition, record.offset)] = delivery
            size += record.size
        self.bytes += size
        return size

    def pop(self, key: OutKey) -> Delivery | None:
        """Forget a delivery (settled, given back or fenced)."""
        out = self.outstanding.pop(key, None)
        if out is not None:
            self.bytes -= out.record.size
            _unwatch(out)
        return out

    def acked(self, out: Delivery, now: float) -> None:
        """An ack arrived: its latency feeds the p99 extension (ACK-2)."""
        self._pending_latencies.append(now - out.first_delivery)

    def acked_many(self, acked: list[Delivery], now: float) -> None:
        """Deliveries a run of plain acks took out of ``outstanding``: their bytes are freed and their
        latencies feed the p99 extension (ACK-2)."""
        self.bytes -= sum([out.record.size for out in acked])
        self._pending_latencies.extend([now - out.first_delivery for out in acked])
        if self.track:
            for out in acked:  # _unwatch, inlined: it runs per message
                watch = out.watch
                if watch is not None:
                    watch.live -= 1
                    out.watch = None

    def take_latencies(self) -> None:
        """Move the step's ack latencies into the histogram and the metrics list (one lock each)."""
        pending = self._pending_latencies
        if pending:
            self.histogram.add_many(pending)
            self.latencies.extend(pending)
            self._pending_latencies = []

    def set_deadline(self, key: OutKey, out: Delivery, seconds: float, now: float) -> int:
        """``modify_ack_deadline`` (ACK-3): the new deadline, watched; returns it in epoch ms."""
        out.deadline = now + seconds
        self._watch(key, out)
        return wall_ms(seconds)

    def drop_partition(self, partition: int) -> None:
        """A partition let go: its deliveries can no longer be acked here."""
        for key in [k for k in self.outstanding if k[0] == partition]:
            self.pop(key)

    def next_check(self) -> float | None:
        """When ``expire`` has something to look at next."""
        return self._heap[0][0] if self._heap else None

    def expire(self, now: float) -> tuple[list[Extension], list[Delivery]]:
        """Extend the leases about to end (ACK-2) and take out those that lapsed (ACK-1).

        Returns the extensions (for Redis) and the lapsed deliveries (already forgotten here; the
        coordinator rewinds their keys).
        """
        heap, outstanding = self._heap, self.outstanding
        extended: list[Extension] = []
        lapsed: list[Delivery] = []
        while heap and heap[0][0] <= now:
            check, _, item = heapq.heappop(heap)
            if isinstance(item, Watch):
                if item.live > 0:
                    partition = item.partition
                    for offset in item.offsets:
                        key = (partition, offset)
                        out = outstanding.get(key)
                        if out is not None and out.watch is item:
                            self._look(key, out, now, extended, lapsed)
                continue
            out = outstanding.get(item)
            if out is None or out.watch is not None or out.check != check:
                continue  # settled, or watched again since (a new deadline, a redelivery)
            self._look(item, out, now, extended, lapsed)
        self.extensions += len(extended)
        self.lapses += len(lapsed)
        return extended, lapsed

    def _look(self, key: OutKey, out: Delivery, now: float, extended: list[Extension], lapsed: list[Delivery]) -> None:
        """A lease's check came: extend it, take it out as lapsed, or watch it again at its deadline."""
        settings = self.settings
        if out.deadline - lease_margin(settings.ack_deadline) <= now < out.deadline \
                and now - out.first_delivery < settings.max_lease_duration:
            seconds = extension_seconds(self.histogram, min_extension=settings.min_duration_per_lease_extension,
                                        max_extension=settings.max_duration_per_lease_extension)
            out.deadline = now + seconds
            extended.append(Extension(key[0], key[1], wall_ms(seconds)))
            self._watch(key, out)
        elif now >= out.deadline:
            self.pop(key)
            lapsed.append(out)
        else:
            self._watch(key, out, check=out.deadline)

    def _watch(self, key: OutKey, out: Delivery, check: float | None = None) -> None:
        """Watch one lease alone from now on (its batch's watch no longer looks at it)."""
        if not self.track:
            return
        _unwatch(out)
        out.check = self._check_time(out.deadline) if check is None else check
        heapq.heappush(self._heap, (out.check, next(self._seq), key))

    def _check_time(self, deadline: float) -> float:
        # Jittered, so that the extensions of many leases do not all land on one step.
        return deadline - lease_margin(self.settings.ack_deadline) * (1.0 - 0.2 * random.random())
