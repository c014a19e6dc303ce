"""``RequestSlots``: the pusher's bound on requests in flight (``max_concurrent_requests``).

A message handed to the pusher takes a slot before its request goes, and gives it back once the
answer is read; while none is free the messages wait in arrival order. A slot given back goes
straight to the oldest waiting message, so the wait ends in the same loop step as the request
before it. ``close`` ends every wait at once with False (the pusher is stopping: those messages are
nacked, not sent), and later ``take``s get False at once.

All methods run on the pusher's event loop.
"""

from __future__ import annotations

import asyncio
from collections import deque


class RequestSlots:
    """``limit`` slots taken and given back by the requests of one pusher.

    Args:
        limit: the most requests in flight at once.
    """

    def __init__(self, limit: int) -> None:
        self.free = limit
        self.closed = False
        self._waiting: deque[asyncio.Future[bool]] = deque()

    @property
    def waiting(self) -> int:
        """Messages waiting for a slot."""
        return len(self._waiting)

    async def take(self) -> bool:
        """Wait for a slot: True with one taken (``give`` it back), False when closed."""
        if self.closed:
            return False
        if self.free and not self._waiting:
            self.free -= 1
            return True
        waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            # Cancelled after a slot was handed to it: pass the slot on.
            if waiter.done() and not waiter.cancelled() and waiter.result():
                self.give()
            raise

    def give(self) -> None:
        """Give a slot back: to the oldest waiting message, else to the free ones."""
        waiting = self._waiting
        while waiting:
            waiter = waiting.popleft()
            if not waiter.done():
                waiter.set_result(True)
                return
        self.free += 1

    def close(self) -> None:
        """End every wait with False; from now on ``take`` gives False."""
        self.closed = True
        waiting, self._waiting = self._waiting, deque()
        for waiter in waiting:
            if not waiter.done():
                waiter.set_result(False)
