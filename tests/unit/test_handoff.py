"""Hand-off alone: the callback pool runs every message once; waiting pulls are answered in order."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from functools import partial
from typing import cast

from ordering_layer.subscriber.handoff import WATCH_INTERVAL, CallbackPool, PullWaiters
from ordering_layer.subscriber.message import Message
from ordering_layer.subscriber.requests import Pull
from tests.checker import wait_until


def test_callback_pool_runs_each_message_once_on_its_workers() -> None:
    """SUB-2: a released batch is handed to the workers in one go; each message runs once."""
    seen: list[int] = []
    lock = threading.Lock()

    def run(message: Message) -> None:
        with lock:
            seen.append(cast(int, message))

    pool = CallbackPool("test-pool", 4, run)
    pool.submit(cast(list[Message], list(range(100))))
    pool.shutdown()
    assert sorted(seen) == list(range(100))


def test_quick_callbacks_run_on_one_worker_and_waiting_messages_wake_more() -> None:
    """SUB-2: callbacks that return at once run on the one worker a hand-out wakes; a message that
    waits behind a callback held in user code gets another worker at the coordinator's next watch
    but one (it was queued at the previous one), so a slow callback does not hold the others."""
    threads: set[str] = set()
    held, entered = threading.Event(), threading.Event()
    ran: list[int] = []

    def run(message: Message) -> None:
        threads.add(threading.current_thread().name)
        if cast(int, message) == -1:
            entered.set()
            held.wait(30)
        ran.append(cast(int, message))

    pool = CallbackPool("test-pool", 4, run)

    def batch_ran(end: int) -> bool:
        return len(ran) == end and pool._idle == 4

    wait_until(lambda: pool._idle == 4, 10, "workers asleep")
    for end in range(100, 500, 100):
        threads.clear()
        pool.submit(cast(list[Message], list(range(end - 100, end))))
        wait_until(partial(batch_ran, end), 10, "the batch ran")
        assert len(threads) == 1  # the worker the hand-out woke
    assert sorted(ran) == list(range(400))
    threads.clear()
    pool.submit(cast(list[Message], [-1, 7]))
    assert entered.wait(10)  # one worker held in user code, 7 waiting behind it
    assert pool.watch(0.0) == 0.0 + WATCH_INTERVAL  # queued since the last look: not overdue yet
    assert ran[-1] != 7
    assert pool.watch(1.0) is not None
    wait_until(lambda: ran[-1] == 7, 10, "7 ran beside the held callback")
    assert len(threads) == 2 and not held.is_set()  # 7 on another worker
    held.set()
    pool.shutdown()
    assert pool.watch(2.0) is None


def test_pulls_are_answered_oldest_first_and_expire_empty() -> None:
    """SUB-1 (pull mode): a release claims the oldest waiting pull, which gets that batch once it is
    handed out; a claimed pull does not time out meanwhile; an unclaimed one past its timeout gets []."""
    waiters = PullWaiters()
    first, second = Pull(5, 1.0, Future()), Pull(7, 2.0, Future())
    waiters.add(first)
    waiters.add(second)
    assert waiters.wanted() == 5 and waiters.next_deadline() == 1.0
    waiters.claim()
    assert waiters.wanted() == 7 and waiters.next_deadline() == 2.0  # the next release is the next pull's
    waiters.expire(1.5)
    assert not first.future.done()  # claimed: its batch is on its way
    batch = cast(list[Message], ["m"])
    waiters.answer(batch)
    assert first.future.result() is batch
    waiters.expire(2.0)
    assert second.future.result() == [] and waiters.wanted() == 0 and waiters.next_deadline() is None


def test_a_claimed_pull_whose_batch_did_not_go_out_waits_again_first_in_line() -> None:
    """SUB-1 (pull mode): a batch given back (Redis failed) or screened out entirely leaves its pull
    waiting, ahead of the pulls that came after it; closing answers claimed pulls too."""
    waiters = PullWaiters()
    first, second = Pull(5, 10.0, Future()), Pull(7, 20.0, Future())
    waiters.add(first)
    waiters.add(second)
    waiters.claim()
    waiters.unclaim()
    assert waiters.wanted() == 5
    waiters.claim()
    waiters.answer([])
    assert waiters.wanted() == 5 and not first.future.done()
    waiters.claim()
    waiters.close()
    assert first.future.result() == [] and second.future.result() == []
