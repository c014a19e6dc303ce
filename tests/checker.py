"""A delivery checker: records every delivery and verifies SUB-1..SUB-5 and DLQ-2 over a run.

Each event is (key, index, message id, subscriber, attempt, action, time), where ``index`` is the
message's position in its key's publish order. ``verify`` walks each key's events in time order:

* SUB-1: a key's deliveries move forward one message at a time; in callback mode at most one
  message of a key is outstanding (across subscribers, ignoring subscribers declared dead);
* SUB-4: a delivery that goes back (a redelivery of m) is followed by m+1, m+2, ... up to the
  highest message of the key delivered before, before anything new, and the run does not end
  before it got there;
* SUB-3: every published message was delivered and finally acked (or dead-lettered);
* SUB-5: no two live subscribers have messages of one key outstanding at the same time;
* DLQ-2: a dead-lettered message had exactly ``max_delivery_attempts`` deliveries.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Event:
    """One recorded delivery or settlement."""

    key: str
    index: int
    message_id: str
    subscriber: str
    attempt: int
    action: str  # "deliver", "ack", "nack", "dead"
    at: float


@dataclass
class DeliveryChecker:
    """Thread-safe recorder of deliveries; ``verify()`` returns the list of violations."""

    published: dict[str, list[str]] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    dead_subscribers: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _index: dict[str, tuple[str, int]] = field(default_factory=dict)

    def expect(self, key: str, message_ids: list[str]) -> None:
        """Declare the publish order of a key."""
        self.published[key] = list(message_ids)
        for index, message_id in enumerate(message_ids):
            self._index[message_id] = (key, index)

    def record(self, message_id: str, subscriber: str, attempt: int, action: str, at: float | None = None) -> None:
        """Record a delivery ("deliver") or what the handler did with it ("ack", "nack", "dead"), or
        "release": the handler is about to ack, so the key's next message may come before the "ack"
        is logged (the ack itself is logged once it took effect).

        ``at`` is a wall-clock time (events from other processes); default: now.
        """
        key, index = self._index[message_id]
        with self._lock:
            self.events.append(Event(key, index, message_id, subscriber, attempt, action,
                                     time.time() if at is None else at))

    def knows(self, message_id: str) -> bool:
        """Whether ``message_id`` was declared (``expect``)."""
        with self._lock:
            return message_id in self._index

    def subscriber_died(self, subscriber: str, at: float | None = None) -> None:
        """A subscriber was killed at ``at``: from then on its outstanding messages are not held."""
        with self._lock:
            self.dead_subscribers[subscriber] = time.time() if at is None else at

    def acked_count(self) -> int:
        """Distinct messages acked or dead-lettered so far."""
        with self._lock:
            return len({e.message_id for e in self.events if e.action in ("ack", "dead")})

    def total(self) -> int:
        """Messages declared."""
        return sum(len(ids) for ids in self.published.values())

    def deliveries(self, key: str | None = None) -> list[Event]:
        """Delivery events (of one key)."""
        with self._lock:
            return [e for e in self.events if e.action == "deliver" and (key is None or e.key == key)]

    def verify(self, *, one_outstanding: bool = True, max_delivery_attempts: int | None = None,
               require_all_settled: bool = True) -> list[str]:
        """Check the recorded run; an empty list means every property held."""
        with self._lock:
            events = sorted(self.events, key=lambda e: e.at)
        problems: list[str] = []
        by_key: dict[str, list[Event]] = defaultdict(list)
        for event in events:
            by_key[event.key].append(event)
        for key, key_events in by_key.items():
            problems.extend(self._verify_key(key, key_events, one_outstanding))
        settled = {e.message_id for e in events if e.action in ("ack", "dead")}
        if require_all_settled:
            for key, ids in self.published.items():
                missing = [i for i, m in enumerate(ids) if m not in settled]
                if missing:
                    problems.append(f"SUB-3 {key}: messages {missing[:10]} never acked or dead-lettered")
        if max_delivery_attempts is not None:
            attempts: dict[str, int] = defaultdict(int)
            for event in events:
                if event.action == "deliver":
                    attempts[event.message_id] += 1
            for event in events:
                if event.action == "dead" and attempts[event.message_id] != max_delivery_attempts:
                    problems.append(f"DLQ-2 {event.key}#{event.index}: dead-lettered after "
                                    f"{attempts[event.message_id]} deliveries, expected {max_delivery_attempts}")
        return problems

    def _verify_key(self, key: str, events: list[Event], one_outstanding: bool) -> list[str]:
        problems: list[str] = []
        previous: int | None = None
        highest = -1
        cascade_until = -1
        holders: dict[int, str] = {}
        for event in events:
            if event.action != "deliver":
                if event.action in ("ack", "nack", "dead", "release"):
                    holders.pop(event.index, None)
                continue
            live = {i: s for i, s in holders.items()
                    if s not in self.dead_subscribers or event.at < self.dead_subscribers[s]}
            others = {s for s in live.values() if s != event.subscriber}
            if others:
                problems.append(f"SUB-5 {key}#{event.index} to {event.subscriber} while {others} hold messages")
            if one_outstanding and live:
                problems.append(f"SUB-1 {key}#{event.index} delivered while {sorted(live)} outstanding")
            i = event.index
            if previous is None:
                if i > highest + 1 and i > 0:
                    problems.append(f"SUB-1 {key}: first delivery is #{i}")
            elif i == previous + 1:
                pass
            elif i <= previous:
                cascade_until = max(cascade_until, highest)
            else:
                problems.append(f"SUB-1/SUB-4 {key}: #{i} delivered right after #{previous}")
            if previous is not None and i > highest and previous < cascade_until:
                problems.append(f"SUB-4 {key}: new #{i} before the cascade reached #{cascade_until}")
            highest = max(highest, i)
            previous = i
            holders[i] = event.subscriber
        if previous is not None and previous < cascade_until:
            problems.append(f"SUB-4 {key}: the cascade stopped at #{previous}, short of #{cascade_until}")
        return problems


def wait_until(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll ``condition`` until true; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
