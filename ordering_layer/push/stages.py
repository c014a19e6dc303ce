"""``StageClock``: when each pushed message passed each step of the pusher, to find where time goes.

A ``Pusher`` given one (``Pusher(..., stages=StageClock())``) marks every message at each step with
the wall clock (``time.time()``, so that marks compare with a publish time or an endpoint's arrival
time taken in another process). ``bench/bench_push.py --stages`` prints the per-step durations.
Without one the pusher marks nothing.
"""

from __future__ import annotations

import time
from typing import Final

# The pusher's steps, in the order a message passes them.
WORKER: Final = "worker"  # one of the pusher's workers (max_concurrent_requests of them) took it
SENDING: Final = "sending"  # its request is built and handed to the HTTP client
ANSWERED: Final = "answered"  # the response's status and body are read
SETTLED: Final = "settled"  # acked or nacked
STEPS: Final = (WORKER, SENDING, ANSWERED, SETTLED)


class StageClock:
    """Per-message marks ``{message_id: {step: time}}``; any thread may mark (one dict write each)."""

    def __init__(self) -> None:
        self.marks: dict[str, dict[str, float]] = {}

    def mark(self, message_id: str, step: str) -> None:
        """Note that the message ``message_id`` passes ``step`` now."""
        self.marks.setdefault(message_id, {})[step] = time.time()

    def clear(self) -> None:
        """Forget every mark (e.g. those of a warm-up)."""
        self.marks = {}
