"""The engine's inbox: many threads post, one thread takes everything waiting at once.

A post is a ``deque.append`` (atomic under the GIL); the poster wakes the engine only when the
engine asked to be woken at that length: at the first event when it is idle, at a full batch when
it is gathering, never while it is working. The poster that wakes it disarms the wake-up, so the
posts that follow before the engine runs (a loop of acks holds the GIL) do not wake it again.
So a busy engine is not woken once per ack, and it takes all waiting events in one go instead of
one queue operation each. ``nudge`` wakes it at once, whatever it waits for (an answer it awaits has
come), until its next ``take``.

A wake-up is a byte sent on a socket pair, so that the engine can wait in one ``select`` for its
events and for a socket of its own (``wait``'s ``readable``: the Redis connection a flush's answer
comes on), woken by whichever comes first.
"""

from __future__ import annotations

import contextlib
import select
import socket
import sys
import weakref
from collections import deque
from itertools import repeat, starmap
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_NEVER = sys.maxsize


class Inbox(Generic[T]):
    """A multi-producer, single-consumer event queue with batched take and armed wake-ups."""

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._wake_at = _NEVER
        self._nudged = False
        self._signalled = False  # a wake-up byte may be unread
        self._receiver, self._sender = socket.socketpair()
        self._receiver.setblocking(False)
        self._sender.setblocking(False)
        # Closed with the inbox: a poster holding it (a message's ack) never writes to a closed socket.
        weakref.finalize(self, _close, self._receiver, self._sender)

    def put(self, item: T) -> None:
        """Post one event (any thread)."""
        items = self._items
        items.append(item)
        if len(items) >= self._wake_at:
            self._wake_at = _NEVER
            self._signal()

    def nudge(self) -> None:
        """Wake the consumer now, whatever it waits for (any thread); a nudge not taken yet is not
        sent again (the consumer looks at the flag before it sleeps and resets it at ``take``, so
        what was posted before this call is seen by the step after the nudge it already has)."""
        if self._nudged:
            return
        self._nudged = True
        self._wake_at = _NEVER
        self._signal()

    def _signal(self) -> None:
        self._signalled = True
        # A full buffer holds wake-ups not read yet: the consumer wakes anyway.
        with contextlib.suppress(BlockingIOError):
            self._sender.send(b"\0")

    def wait(self, size: int, timeout: float, readable: Any = None) -> bool:
        """Consumer side: return once ``size`` events are waiting or a nudge came (True), or the
        ``readable`` socket has something to read (True), or after ``timeout`` s.

        The consumer arms the wake-up before it looks at the length, and posters look at the armed
        length after they append, so a post can never fall between the look and the sleep.
        """
        items = self._items
        if len(items) >= size or self._nudged:
            return True
        if self._signalled:
            self._drain()
        self._wake_at = size
        try:
            if len(items) < size and not self._nudged:
                waited = [self._receiver] if readable is None else [self._receiver, readable]
                try:
                    ready, _, _ = select.select(waited, [], [], max(timeout, 0.0))
                except (OSError, ValueError):
                    return True  # ``readable`` was closed (its connection failed): its reader finds out
                if readable is not None and readable in ready:
                    return True
        finally:
            self._wake_at = _NEVER
        return len(items) >= size or self._nudged

    def _drain(self) -> None:
        self._signalled = False
        try:
            while self._receiver.recv(4096):
                pass
        except BlockingIOError:
            pass

    def take(self) -> list[T]:
        """Consumer side: every event waiting now, oldest first (a nudge is taken with them)."""
        self._nudged = False
        items = self._items
        # As many pops as there are events now, in C; posters only append, so none is lost.
        return list(starmap(items.popleft, repeat((), len(items))))

    def __len__(self) -> int:
        return len(self._items)


def _close(*sockets: socket.socket) -> None:
    for sock in sockets:
        sock.close()
