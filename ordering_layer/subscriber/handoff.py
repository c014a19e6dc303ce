"""Hand-off of released messages to user code: the callback pool and the waiting pulls.

Callback mode: a released batch joins the ``CallbackPool``'s queue in one go; a worker is woken
when none is awake, and more when messages wait longer than the coordinator's watch interval. Pull
mode: ``PullWaiters`` holds the pulls waiting for messages (oldest first); a release for the oldest
claims it, and it is answered with that batch once Redis took the batch's attempts (or waits again
when nothing of it went out); those whose timeout passed unclaimed are answered with an empty list.
Between pulls the next pull's messages are released ahead, so that it is answered at once.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Collection

from ordering_layer._core import LeaseTable, whole_batches
from ordering_layer.subscriber.message import Message
from ordering_layer.subscriber.requests import Pull
from ordering_layer.subscriber.runs import Hooks, Item, items_of, run_item

# Whether a lease handle still names an outstanding delivery: the engine's table itself (read
# without Python per message), or any callable of a handle.
Holds = LeaseTable | Callable[[int], bool]

WATCH_INTERVAL = 0.001  # seconds between looks for messages waiting for a worker, while some wait
HELD_AFTER = 0.001  # seconds an awake worker takes nothing before it counts as held in a callback


class CallbackPool:
    """``workers`` named daemon threads running callbacks from one queue.

    Unlike ``ThreadPoolExecutor`` it makes no Future per task, and a released batch is handed over in
    one go. As few workers are awake as keep the queue moving: a hand-out wakes one worker when none
    is awake, or when every awake one is held in a callback (it took nothing for ``HELD_AFTER``, as
    the coordinator's ``watch`` saw at each step); a worker that finds the queue empty sleeps; and
    ``watch`` (every ``WATCH_INTERVAL`` while messages wait) wakes more when messages that were
    queued at its previous look still wait: the awake workers are held in callbacks that take time
    (a slow handler, I/O), and the waiting messages get as many more workers as there are of them.
    So callbacks that return at once run on one thread (with the interpreter lock, more threads
    would only take turns, each woken for each hand-out), slow ones on as many threads as they
    need, and a callback held long does not leave the next hand-outs waiting for a watch.
    """

    def __init__(self, name: str, workers: int, run: Callable[[Message], None], hooks: Hooks | None = None) -> None:
        self._queue: deque[Item | None] = deque()
        self._run = run
        self._hooks = hooks or Hooks(lambda message: True, lambda messages: None, lambda message: True)
        self._ready = threading.Condition(threading.Lock())
        self._idle = 0  # workers asleep, waiting for the queue (changed under _ready)
        self._queued = 0  # messages ever queued (the coordinator's thread)
        self._queued_at_watch = 0  # _queued at the previous watch
        self._taken = [0] * workers  # messages taken per worker (each slot written by its worker only)
        self._asleep = [False] * workers  # each slot written by its worker, under _ready
        self._seen = [0] * workers  # the coordinator's: _taken at its previous look
        self._moved = [0.0] * workers  # the coordinator's: when it last saw the worker take one or sleep
        self._free = True  # the coordinator's: an awake worker is not held in a callback
        self._threads = [threading.Thread(target=self._work, args=(i,), name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, messages: list[Message]) -> None:
        """Queue messages for callbacks (the coordinator's thread): a key's consecutive messages (a
        run, released when few keys were ready) as one item, run by one worker in order (``runs``)."""
        items = items_of(messages)
        self._queued += len(items)
        self._queue.extend(items)
        with self._ready:
            if self._idle and (self._idle == len(self._threads) or not self._free):
                self._ready.notify(1)
                self._free = True  # the worker woken, until the next look

    def watch(self, now: float) -> float | None:
        """Wake a worker for each message that was queued at the previous watch and still waits, and
        note whether every awake worker is held in a callback (the coordinator's thread, each step);
        returns when to watch again (None: nothing waits)."""
        taken, seen, moved, asleep = self._taken, self._seen, self._moved, self._asleep
        free = False
        for index, count in enumerate(taken):
            if count != seen[index] or asleep[index]:
                seen[index], moved[index] = count, now
                free = free or not asleep[index]
            elif now - moved[index] < HELD_AFTER:
                free = True
        self._free = free
        overdue = self._queued_at_watch - sum(taken)
        self._queued_at_watch = self._queued
        if overdue > 0:
            with self._ready:
                if self._idle:
                    self._ready.notify(min(overdue, self._idle))
        return now + WATCH_INTERVAL if self._queue else None

    def _work(self, index: int) -> None:
        pending, ready, taken, run = self._queue, self._ready, self._taken, self._run
        count = 0
        while True:
            try:
                message = pending.popleft()
            except IndexError:
                # Look again under the lock: submit extends before it takes the lock to notify.
                with ready:
                    self._idle += 1
                    self._asleep[index] = True
                    while not pending:
                        ready.wait()
                    self._asleep[index] = False
                    self._idle -= 1
                continue
            count += 1
            taken[index] = count
            if message is None:
                return
            if isinstance(message, list):
                run_item(message, run, self._hooks)
            else:
                run(message)

    def shutdown(self) -> None:
        """Let queued callbacks finish, then end the threads."""
        self._queue.extend([None] * len(self._threads))
        with self._ready:
            self._ready.notify_all()
        for thread in self._threads:
            thread.join()


AHEAD_AT_LEAST = 64  # messages kept released ahead of the pulls, at least
AHEAD_AT_MOST = 1024  # the most the floor above grows to while pulls find nothing ready


class PullWaiters:
    """Pulls waiting for messages (oldest first), the releases claimed for them or made ahead of
    them, and the messages released ahead that no pull took yet (under the engine's lock: the
    coordinator, or a pulling thread adding its pull).

    A release is claimed for the oldest waiting pull, or, when none waits, made *ahead*: batches of
    at most the latest pull's size per key, a floor of messages or the latest pull's size if
    larger, so that the next pulls are answered at once instead of after a coordinator step and a
    Redis round trip each (``OrderedConsumer.poll`` pulls one message at a time). The floor starts
    at ``AHEAD_AT_LEAST`` and doubles, up to ``AHEAD_AT_MOST``, each time a pull finds nothing ready
    while releases ahead are under way: the pulls outrun a refill. Messages released
    ahead are ``ready`` once Redis took their attempts (as released, not started: ``Dispatcher``);
    a pull takes whole per-key batches of them, never more than its size, so a key's batch never
    spans two pulls (a nack rewinds only messages its own pull returned).
    The messages a pull took from ``ready`` are kept in ``served`` until the coordinator notes their
    start (``Settlement.starts``).
    """

    def __init__(self) -> None:
        self._waiting: deque[Pull] = deque()
        self._claimed: deque[tuple[Pull | None, int]] = deque()  # (its pull, None: ahead; count), in release order
        self._ready: list[Message] = []  # released ahead, their attempts written
        self._ahead = 0  # the latest pull's size: how many messages to keep released ahead
        self._floor = AHEAD_AT_LEAST  # how many to keep released ahead at least
        self._ahead_claimed = 0  # released ahead, their flush not answered yet
        self.served: list[Message] = []  # taken from ready by pulls, their start not noted yet

    def add(self, pull: Pull, holds: Holds) -> list[Message]:
        """A pull arrived: answered from ``ready`` at once if it has messages (``serve``)."""
        if not self._ready and self._ahead_claimed and not self._waiting:
            self._floor = min(AHEAD_AT_MOST, 2 * self._floor)
        self._ahead = pull.max_messages
        self._waiting.append(pull)
        return self.serve(holds)

    def refill(self) -> bool:
        """Whether the coordinator is to be woken after a pull: one waits, or fewer than half the
        messages to keep released ahead are ready or on their way."""
        return bool(self._waiting) or 2 * (len(self._ready) + self._ahead_claimed) < max(self._ahead, self._floor)

    def wanted(self) -> tuple[int, bool]:
        """How many messages the next release is for, and whether for the oldest waiting pull (True)
        or ahead of the pulls (False); 0 when no release is wanted."""
        if self._waiting:
            return self._waiting[0].max_messages, True
        if not self._ahead:  # no pull came yet
            return 0, False
        return max(0, max(self._ahead, self._floor) - len(self._ready) - self._ahead_claimed), False

    def per_key(self) -> int:
        """How many messages of a key the next release may hold: the oldest waiting pull's size, or
        ahead of the pulls, the latest pull's (a key's batch never spans two pulls)."""
        return self._waiting[0].max_messages if self._waiting else self._ahead

    def claim(self, count: int, for_pull: bool) -> None:
        """``count`` messages were released for the oldest waiting pull (it no longer waits for
        another) or ahead of the pulls."""
        if for_pull:
            self._claimed.append((self._waiting.popleft(), count))
        else:
            self._claimed.append((None, count))
            self._ahead_claimed += count

    def answer(self, messages: list[Message], holds: Holds) -> list[Message]:
        """The oldest claimed release went out: its pull gets the messages (with none it waits again,
        first in line); a release ahead joins ``ready`` and answers the pulls waiting (``serve``)."""
        pull, count = self._claimed.popleft()
        if pull is None:
            self._ahead_claimed -= count
            self._ready.extend(messages)
            return self.serve(holds)
        if messages:
            pull.future.set_result(messages)
        else:
            self._waiting.appendleft(pull)
        return []

    def unclaim(self) -> None:
        """The oldest claimed release was given back: its pull waits again, first in line."""
        pull, count = self._claimed.popleft()
        if pull is None:
            self._ahead_claimed -= count
        else:
            self._waiting.appendleft(pull)

    def serve(self, holds: Holds) -> list[Message]:
        """Answer the waiting pulls from ``ready``: whole per-key batches, in release order, up to each
        pull's size; a message whose lease ``holds`` no longer (its partition let go, its lease lapsed)
        is dropped. Returns what is to be given back: everything ready, when its first batch is larger
        than the oldest waiting pull (which then waits for a release of its own)."""
        ready, waiting = self._ready, self._waiting
        while waiting and ready:
            pull = waiting[0]
            taken, looked = whole_batches(ready, pull.max_messages, holds)
            del ready[:looked]
            if not taken:
                return self.withdraw(None) if ready else []
            waiting.popleft()
            pull.future.set_result(taken)
            self.served.extend(taken)
        return []

    def take_served(self) -> list[Message]:
        """The messages pulls took from ``ready`` since the last call (their starts are to be noted)."""
        served = self.served
        if served:
            self.served = []
        return served

    def withdraw(self, partitions: Collection[int] | None) -> list[Message]:
        """Take the ready messages of ``partitions`` (None: all) out, to be given back."""
        ready = self._ready
        if partitions is None:
            taken = list(ready)
            ready.clear()
            return taken
        taken = [message for message in ready if message.record.partition in partitions]
        if taken:
            self._ready = [message for message in ready if message.record.partition not in partitions]
        return taken

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
        while self._waiting:
            self._waiting.popleft().future.set_result([])
        while self._claimed:
            pull, _ = self._claimed.popleft()
            if pull is not None:
                pull.future.set_result([])
