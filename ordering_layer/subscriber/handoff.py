"""Hand-off of released messages to user code: the callback pool and the waiting pulls.

Callback mode: a released batch joins the ``CallbackPool``'s queue in one go; a worker is woken
when none is awake, and more when messages wait longer than the coordinator's watch interval. Pull
mode: ``PullWaiters`` holds the pulls waiting for messages (oldest first); a release for the oldest
claims it, and it is answered with that batch once Redis took the batch's attempts (or waits again
when nothing of it went out); those whose timeout passed unclaimed are answered with an empty list.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from ordering_layer.subscriber.message import Message
from ordering_layer.subscriber.requests import Pull

WATCH_INTERVAL = 0.001  # seconds between looks for messages waiting for a worker, while some wait


class CallbackPool:
    """``workers`` named daemon threads running callbacks from one queue.

    Unlike ``ThreadPoolExecutor`` it makes no Future per task, and a released batch is handed over in
    one go. As few workers are awake as keep the queue moving: a hand-out wakes one worker when none
    is awake, a worker that finds the queue empty sleeps, and ``watch`` (the coordinator, every
    ``WATCH_INTERVAL`` while messages wait) wakes more when messages that were queued at its previous
    look still wait: the awake workers are held in callbacks that take time (a slow handler, I/O),
    and the waiting messages get as many more workers as there are of them. So callbacks that return
    at once run on one thread (with the interpreter lock, more threads would only take turns, each
    woken for each hand-out), and slow ones on as many threads as they need.
    """

    def __init__(self, name: str, workers: int, run: Callable[[Message], None]) -> None:
        self._queue: deque[Message | None] = deque()
        self._run = run
        self._ready = threading.Condition(threading.Lock())
        self._idle = 0  # workers asleep, waiting for the queue (changed under _ready)
        self._queued = 0  # messages ever queued (the coordinator's thread)
        self._queued_at_watch = 0  # _queued at the previous watch
        self._taken = [0] * workers  # messages taken per worker (each slot written by its worker only)
        self._threads = [threading.Thread(target=self._work, args=(i,), name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, messages: list[Message]) -> None:
        """Queue messages for callbacks (the coordinator's thread)."""
        self._queued += len(messages)
        self._queue.extend(messages)
        with self._ready:
            if self._idle == len(self._threads):
                self._ready.notify(1)

    def watch(self, now: float) -> float | None:
        """Wake a worker for each message that was queued at the previous watch and still waits
        (the coordinator's thread); returns when to watch again (None: nothing waits)."""
        overdue = self._queued_at_watch - sum(self._taken)
        self._queued_at_watch = self._queued
        if overdue > 0:
            with self._ready:
                if self._idle:
                    self._ready.notify(min(overdue, self._idle))
        return now + WATCH_INTERVAL if self._queue else None

    def _work(self, index: int) -> None:
        pending, ready, taken = self._queue, self._ready, self._taken
        count = 0
        while True:
            try:
                message = pending.popleft()
            except IndexError:
                # Look again under the lock: submit extends before it takes the lock to notify.
                with ready:
                    self._idle += 1
                    while not pending:
                        ready.wait()
                    self._idle -= 1
                continue
            count += 1
            taken[index] = count
            if message is None:
                return
            self._run(message)

    def shutdown(self) -> None:
        """Let queued callbacks finish, then end the threads."""
        self._queue.extend([None] * len(self._threads))
        with self._ready:
            self._ready.notify_all()
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
