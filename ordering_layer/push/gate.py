"""``EndpointGate``: the pusher's backoff while its endpoint cannot be reached.

A request that got no HTTP answer at all (refused or reset connection, DNS failure, timeout) is
nacked like any failure, and its key backs off by the subscription's retry policy (DLQ-1); but the
other keys' messages would go on to the same unreachable endpoint, one failed request each, as fast
as they come. So after such a failure the gate closes: the next request waits ``initial`` seconds
and goes alone (a probe); while probes fail the wait doubles up to ``maximum``. Any HTTP answer
(whatever its status: the endpoint is up) opens the gate again. Messages waiting at the gate are
not nacked: they stay leased (their leases are extended) and go once it opens, so an endpoint down
for a while costs one request per wait, not one per message, and loses nothing. ``close`` (the
pusher is stopping) lets every waiting request through at once, to be nacked rather than sent.

All methods run on the pusher's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable


class EndpointGate:
    """Lets requests through while the endpoint answers; one probe at a time, backing off, while not.

    Args:
        initial: seconds before the first probe after a failure.
        maximum: the longest wait between probes.
        clock: the event loop's clock (``loop.time``).
    """

    def __init__(self, initial: float = 0.1, maximum: float = 10.0, clock: Callable[[], float] | None = None) -> None:
        self._initial = initial
        self._maximum = maximum
        self._clock = clock or asyncio.get_running_loop().time
        self.failures = 0  # requests in a row that got no answer (0: open)
        self._probing = False  # a probe is in flight
        self._opens_at = 0.0  # when the next probe may go
        self._closed = False
        self._changed = asyncio.Condition()

    @property
    def is_open(self) -> bool:
        """True while requests go through unhindered."""
        return self.failures == 0

    async def enter(self) -> bool:
        """Wait until a request may go; True when it goes as the probe (report how it ended)."""
        async with self._changed:
            while self.failures and not self._closed:
                wait = self._opens_at - self._clock()
                if not self._probing and wait <= 0:
                    self._probing = True
                    return True
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), None if self._probing else wait)
            return False

    async def answered(self, probe: bool) -> None:
        """A request got an HTTP answer: the endpoint is up, the gate opens."""
        async with self._changed:
            if probe:
                self._probing = False
            if self.failures:
                self.failures = 0
                self._changed.notify_all()

    async def unreachable(self, probe: bool) -> bool:
        """A request got no answer: the gate closes (or stays closed, waiting longer). False when
        that changed nothing (a request sent before the gate closed: the probes set the pace now)."""
        async with self._changed:
            if probe:
                self._probing = False
            elif self.failures:
                return False
            self.failures += 1
            self._opens_at = self._clock() + min(self._maximum, self._initial * 2 ** min(self.failures - 1, 30))
            self._changed.notify_all()
            return True

    async def close(self) -> None:
        """End every wait (``enter`` returns False): the pusher is stopping."""
        async with self._changed:
            self._closed = True
            self._changed.notify_all()

    def wait_left(self) -> float:
        """Seconds until the next probe may go (0 when open)."""
        return max(0.0, self._opens_at - self._clock()) if self.failures else 0.0
