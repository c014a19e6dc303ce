"""Hand-off of released messages to user code: the callback pool and the waiting pulls.

Callback mode: a released batch joins the ``CallbackPool``'s queue in one go and as many idle
workers are woken as there are new messages. Pull mode: ``PullWaiters`` holds the pulls waiting for
messages (oldest first); a release for the oldest claims it, and it is answered with that batch
once Redis took the batch's attempts (or waits again when nothing of it went out); those whose
timeout passed unclaimed are answered with an empty list.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

from ordering_layer.subscriber.message import Message
from ordering_layer.subscriber.requests import Pull


class CallbackPool:
    """``workers`` named daemon threads running callbacks from one queue.

    Unlike ``ThreadPoolExecutor`` it makes no Future per task, and a released batch is handed over
    in one go: the messages join a deque and only as many idle workers are woken as there are new
    messages; a worker that is awake takes the next message without waiting on a lock.
    """

    def __init__(self, name: str, workers: int, run: Callable[[Message], None]) -> None:
        self._queue: deque[Message | None] = deque()
        self._run = run
        self._ready = threading.Condition(threading.Lock())
        self._idle = 0
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, messages: list[Message]) -> None:
        """Queue messages for callbacks."""
        self._put(messages)

    def _put(self, items: Sequence[Message | None]) -> None:
        self._queue.extend(items)
        with self._ready:
            if self._idle:
                self._ready.notify(min(len(items), self._idle))

    def _work(self) -> None:
        pending, ready = self._queue, self._ready
        while True:
            try:
                message = pending.popleft()
            except IndexError:
                # Look again under the lock: _put extends before it takes the lock to notify.
                with ready:
                    self._idle += 1
                    while not pending:
                        ready.wait()
                    self._idle -= 1
                continue
            if message is None:
                return
            self._run(message)

    def shutdown(self) -> None:
        """Let queued callbacks finish, then end the threads."""
        self._put([None] * len(self._threads))
        for thread in self._threads:
            thread.join()


class PullWaiters:
    """Pulls waiting for messages, oldest first, and those claimed by a release (coordinator only)."""

    def __init__(self) -> None:
        self._waiting: deque[Pull] = deque()
        self._claimed: deque[Pull] = deque()  # served by released batches, in release order

    def add(self, pull: Pull) -> None:
        """A pull arrived."""
        self._waiting.append(pull)

    def wanted(self) -> int:
        """How many messages the oldest waiting pull takes (0: none waits)."""
        return self._waiting[0].max_messages if self._waiting else 0

    def claim(self) -> None:
        """A batch was released for the oldest waiting pull: it no longer waits for another."""
        self._claimed.append(self._waiting.popleft())

    def answer(self, messages: list[Message]) -> None:
        """Give the oldest claimed pull its messages; with none it waits again, first in line."""
        pull = self._claimed.popleft()
        if messages:
            pull.future.set_result(messages)
        else:
            self._waiting.appendleft(pull)

    def unclaim(self) -> None:
        """The oldest claimed pull's batch was given back: it waits again, first in line."""
        self._waiting.appendleft(self._claimed.popleft())

    def expire(self, now: float) -> None:
        """Answer the waiting pulls whose timeout passed with nothing."""
        waiting = self._waiting
        while waiting and waiting[0].deadline <= now:
            waiting.popleft().future.set_result([])

    def next_deadline(self) -> float | None:
        """When the oldest waiting pull times out."""
        return self._waiting[0].deadline if self._waiting else None

    def close(self) -> None:
        """Answer every pull, waiting or claimed, with nothing (the engine is closing)."""
        for pulls in (self._waiting, self._claimed):
            while pulls:
                pulls.popleft().future.set_result([])
