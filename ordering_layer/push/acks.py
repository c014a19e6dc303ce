"""``PassAcks``: the acks of one pass of the pusher's event loop, sent to the engine together.

The answers read in one pass of the loop (one ``select``: every response that came meanwhile) ack
their messages as one event (``Subscriber.acknowledge``): the engine's inbox is written and the
engine woken once per pass, not once per answer. Nothing waits for a batch to fill: the acks go at
the end of the pass they were made in (a callback scheduled by the first of them).

All methods run on the pusher's event loop.
"""

from __future__ import annotations

import asyncio

from ordering_layer.subscriber import Message, Subscriber


class PassAcks:
    """Collects the acks of a pass of the loop and sends them at its end."""

    def __init__(self) -> None:
        self._pending: list[Message] = []

    def ack(self, message: Message) -> None:
        """Ack ``message`` with the other acks of this pass."""
        pending = self._pending
        pending.append(message)
        if len(pending) == 1:
            asyncio.get_running_loop().call_soon(self._send)

    def _send(self) -> None:
        pending, self._pending = self._pending, []
        Subscriber.acknowledge(pending)
