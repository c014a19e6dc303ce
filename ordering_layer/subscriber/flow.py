"""Flow control (SUB-7): the release budget and the one gate state of the fetch.

``FlowControl`` bounds what is outstanding at a subscriber. The gate is OPEN (the fetch takes
records), HELD (over a limit: the fetch takes no records, librdkafka keeps its prefetch) or PAUSED
(held longer than ``hold_before_pause``: the fetch serves the consumer's events again, so that the
group protocol and rebalance callbacks keep running while no records are taken). Over any limit the
gate closes; it opens again under ``resume_fraction`` of every limit. The coordinator moves it
between OPEN and HELD after each step; the fetch thread moves it from HELD to PAUSED.

Through ``consume()`` (no native fetch) PAUSED pauses the assignment in the consumer, as records
and events come through the same queue. Why HELD before PAUSED then: ``pause()`` throws librdkafka's
prefetch away and the resume costs a refetch of ~0.2-0.5 s, which a short hold at every release
step would pay again and again. The native fetch never pauses: the partitions' queues are apart from
the events, and librdkafka bounds each one's prefetch (``queued.max.messages.kbytes``).

Apart from the gate, the fetch takes no records while enough are *ready* (``ample``: at least
``max_ready`` keys a release could take now, by default ``max_messages``; it ends under
``resume_fraction`` of it). The partitions are not paused for it: librdkafka keeps prefetching into
its own compact queue, which the fetch takes from again at once when the ready keys run low. Records
taken into the key queues long before they can go out cost memory and cache misses for nothing
(measured: the history of ``bench/RESULTS.md``). Keys that cannot go out (outstanding, backing off,
in a recovery walk) do not count as ready, so the fetch still reads past them up to the buffer
limit.

While the gate is closed by the buffer limit (not over the outstanding limits, SUB-7) or records are
ample, the partitions *short* of records still take some (``short``; the native fetch only, whose
partitions' queues are apart). Otherwise a partition whose fetch started late, or that was assigned
while the others' records filled the buffer, would wait for the buffer to drain under
``resume_fraction``, its keys idle while the other partitions' keys go on (SUB-2). A partition is
short under an eighth of its equal share of the buffer limit (while records are ample and the gate
OPEN: with none buffered) and stays short until it holds its share; it may take up to the share.
The buffer holds at most about twice its limit so.

Also the fetch takes no records while ``max_in_flight`` records it posted wait for the coordinator:
the gate moves only once per coordinator step, and a fetch thread left to run through a long step
would post tens of thousands of records more, each a live object for the garbage collector to walk
until it is released.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Mapping

from ordering_layer.config import FlowControl

MIN_READY = 500  # the smallest max_ready: one fetch batch
# The buffer bound (``FlowGate.buffer_limit``): records fetched and not yet released. By count for
# small records: 40,000 of 100 B hold a backlog's batches of many partitions at once, so that the
# keys of a partition whose records were drained first seldom wait while the buffer is full of the
# other partitions' (bench (f), 100 keys over 6 partitions: with 20,000, 20 keys ended 2 s behind
# the rest). More costs the hot keys: the buffer fills with their records (scenario (i), Zipf keys:
# 178,709 / 165,134 msg/s at 20,000, 178,720 / 176,409 at 40,000, 139,346 / 168,103 at 60,000).
# By bytes for large records, as librdkafka bounds its own queue (queued.max.messages.kbytes):
# 64 MiB at the average size of the records fetched lately.
MAX_BUFFERED = 40_000
MAX_BUFFERED_BYTES = 64 * 1024 * 1024
SHORT_FRACTION = 8  # a partition is short under 1/8 of its equal share of the buffer limit


class Gate(enum.Enum):
    """The fetch's state under flow control."""

    OPEN = "open"
    HELD = "held"
    PAUSED = "paused"


class FlowGate:
    """Limits of one engine and its fetch gate.

    Args:
        limits: ``max_messages`` and ``max_bytes`` outstanding.
        max_buffered: fetched records not yet released that close the gate too (memory bound);
            fewer when ``max_buffered_bytes`` of them, at the average size of the records fetched
            lately, come first (``buffer_limit``).
        max_buffered_bytes: the payload bytes of buffered records that close the gate (estimated).
        resume_fraction: the gate opens under this fraction of every limit.
        hold_before_pause: seconds HELD before the fetch pauses the assignment.
        max_in_flight: records fetched and posted that the coordinator has not taken yet, beyond
            which the fetch waits.
        max_ready: ready keys beyond which the fetch takes no records (``ample``); default
            ``limits.max_messages``, at least ``MIN_READY``.
    """

    def __init__(self, limits: FlowControl, *, max_buffered: int = MAX_BUFFERED,
                 max_buffered_bytes: int = MAX_BUFFERED_BYTES, resume_fraction: float = 0.8,
                 hold_before_pause: float = 1.0, max_in_flight: int = 2_000, max_ready: int | None = None) -> None:
        self.limits = limits
        self.max_buffered = max_buffered
        self.max_buffered_bytes = max_buffered_bytes
        self.record_bytes = 0.0  # the average payload size of the records fetched lately (0: none yet)
        self.max_ready = max(limits.max_messages, MIN_READY) if max_ready is None else max_ready
        self.ample = False  # max_ready keys are ready: the fetch takes no records until under resume_fraction
        self.max_in_flight = max_in_flight
        self.in_flight = 0  # posted by the fetch, not yet taken by the coordinator
        self.resume_fraction = resume_fraction
        self.hold_before_pause = hold_before_pause
        self.state = Gate.OPEN
        self._since = 0.0
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified when the fetch may take records again
        self.on_room: Callable[[], None] | None = None  # called with it (wakes a fetch waiting in librdkafka)
        # Partitions short of records while the gate is not OPEN or records are ample, with how
        # many each may still take (see the module's documentation); replaced whole by the coordinator.
        self.short: dict[int, int] = {}
        # Over max_messages or max_bytes outstanding, and not yet under resume_fraction of both:
        # no partition takes records then, short or not (SUB-7).
        self.limited = False

    def buffer_limit(self) -> int:
        """The buffered records that close the gate: ``max_buffered``, or fewer when that many of
        the records fetched lately would hold more than ``max_buffered_bytes``."""
        size = self.record_bytes
        if size <= 0:
            return self.max_buffered
        return max(1, min(self.max_buffered, int(self.max_buffered_bytes / size)))

    def budget(self, outstanding: int, outstanding_bytes: int) -> tuple[int, int]:
        """How many more messages and payload bytes may be released now."""
        limits = self.limits
        return limits.max_messages - outstanding, limits.max_bytes - outstanding_bytes

    def update(self, outstanding: int, outstanding_bytes: int, buffered: int, now: float, ready: int = 0) -> None:
        """Coordinator: close the gate over a limit, open it under ``resume_fraction`` of all; the
        same for ``ample`` with ``ready`` keys."""
        limits, fraction = self.limits, self.resume_fraction
        if ready >= self.max_ready:
            self.ample = True
        elif self.ample and ready < self.max_ready * fraction:
            with self._lock:
                self.ample = False
                self._notify()
        buffer_limit = self.buffer_limit()
        limited = outstanding >= limits.max_messages or outstanding_bytes >= limits.max_bytes
        below = outstanding < limits.max_messages * fraction and outstanding_bytes < limits.max_bytes * fraction
        self.limited = limited or (self.limited and not below)
        over = limited or buffered >= buffer_limit
        under = below and buffered < buffer_limit * fraction
        with self._lock:
            if over and self.state is Gate.OPEN:
                self.state, self._since = Gate.HELD, now
            elif under and self.state is not Gate.OPEN:
                self.state = Gate.OPEN
                self._notify()

    def _notify(self) -> None:
        self._room.notify_all()
        if self.on_room is not None:
            self.on_room()

    def update_short(self, buffered: Mapping[int, int]) -> None:
        """Coordinator: ``short`` from the records each owned partition has buffered, while the gate
        is not OPEN or records are ample, and not over the outstanding limits; empty otherwise. A
        fetch waiting is woken when the short partitions change."""
        if (self.state is Gate.OPEN and not self.ample) or self.limited:
            short: dict[int, int] = {}
        else:
            share = max(1, self.buffer_limit() // max(1, len(buffered)))
            # Records ample while the gate is OPEN: only a partition with none buffered is short, so
            # that the others' records stay in librdkafka's prefetch.
            enter = share // SHORT_FRACTION if self.state is not Gate.OPEN else 1
            short = {partition: share - count for partition, count in buffered.items()
                     if count < (share if partition in self.short else enter)}
        changed = short.keys() != self.short.keys()
        self.short = short
        if changed:
            with self._lock:
                self._notify()

    def posted(self, records: int, payload_bytes: int = 0) -> None:
        """Fetch thread: ``records`` were posted to the coordinator, ``payload_bytes`` in all (the
        average size of the fetched records follows: a quarter of the way to each batch's)."""
        with self._lock:
            self.in_flight += records
        if records and payload_bytes:
            size = payload_bytes / records
            self.record_bytes = size if self.record_bytes <= 0 else self.record_bytes + (size - self.record_bytes) / 4

    def taken(self, records: int) -> None:
        """Coordinator: ``records`` posted by the fetch were taken."""
        with self._lock:
            self.in_flight -= records
            if self.in_flight < self.max_in_flight <= self.in_flight + records:
                self._notify()

    def room_to_fetch(self) -> bool:
        """Fetch thread: fewer than ``max_in_flight`` posted records wait for the coordinator."""
        return self.in_flight < self.max_in_flight

    def wait_for_room(self, timeout: float) -> None:
        """Fetch thread: wait up to ``timeout`` s while the gate is not OPEN, ``max_in_flight`` posted
        records wait for the coordinator or the ready keys are ``ample``; returns as soon as they end
        (or the short partitions change)."""
        with self._room:
            if self.state is not Gate.OPEN or self.in_flight >= self.max_in_flight or self.ample:
                self._room.wait(timeout)

    def fetch_state(self, now: float) -> Gate:
        """Fetch thread: the state to act on; HELD turns PAUSED once held ``hold_before_pause`` s."""
        with self._lock:
            if self.state is Gate.HELD and now - self._since >= self.hold_before_pause:
                self.state = Gate.PAUSED
            return self.state
