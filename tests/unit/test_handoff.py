"""Hand-off alone: the callback pool runs every message once; waiting pulls are answered in order."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import cast

from ordering_layer.subscriber.handoff import CallbackPool, PullWaiters
from ordering_layer.subscriber.message import Message
from ordering_layer.subscriber.requests import Pull


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
