"""The engine's inbox: many threads post, one thread takes everything waiting at once.

A post is a ``deque.append`` (atomic under the GIL); the poster wakes the engine only when the
engine asked to be woken at that length: at the first event when it is idle, at a full batch when
it is gathering, never while it is working. The poster that wakes it disarms the wake-up, so the
posts that follow before the engine runs (a loop of acks holds the GIL) do not set the event again.
So a busy engine is not woken once per ack, and it takes all waiting events in one go instead of
one queue operation each. ``nudge`` wakes it at once, whatever it waits for (an answer it awaits has
come), until its next ``take``.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")

_NEVER = sys.maxsize


class Inbox(Generic[T]):
    """A multi-producer, single-consumer event queue with batched take and armed wake-ups."""

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._wake = threading.Event()
        self._wake_at = _NEVER
        self._nudged = False

    def put(self, item: T) -> None:
        """Post one event (any thread)."""
        items = self._items
        items.append(item)
        if len(items) >= self._wake_at:
            self._wake_at = _NEVER
            self._wake.set()

    def nudge(self) -> None:
        """Wake the consumer now, whatever it waits for (any thread)."""
        self._nudged = True
        self._wake_at = _NEVER
        self._wake.set()

    def wait(self, size: int, timeout: float) -> bool:
        """Consumer side: return once ``size`` events are waiting or a nudge came (True) or after
        ``timeout`` s.

        The consumer arms the wake-up before it looks at the length, and posters look at the armed
        length after they append, so a post can never fall between the look and the sleep.
        """
        items = self._items
        if len(items) >= size or self._nudged:
            return True
        self._wake.clear()
        self._wake_at = size
        try:
            if len(items) < size and not self._nudged:
                self._wake.wait(timeout)
        finally:
            self._wake_at = _NEVER
        return len(items) >= size or self._nudged

    def take(self) -> list[T]:
        """Consumer side: every event waiting now, oldest first (a nudge is taken with them)."""
        self._nudged = False
        items = self._items
        return [items.popleft() for _ in range(len(items))]

    def __len__(self) -> int:
        return len(self._items)
