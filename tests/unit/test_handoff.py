"""Hand-off alone: the callback pool runs every message once; waiting pulls are answered in order."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from functools import partial
from types import SimpleNamespace
from typing import cast

from ordering_layer.subscriber.handoff import (
    AHEAD_AT_LEAST,
    AHEAD_AT_MOST,
    HELD_AFTER,
    WATCH_INTERVAL,
    CallbackPool,
    PullWaiters,
)
from ordering_layer.subscriber.message import Message
from ordering_layer.subscriber.requests import Pull
from ordering_layer.subscriber.runs import Hooks
from tests.checker import wait_until


def numbered(numbers: list[int]) -> list[Message]:
    """Messages of keys of their own (``n``: the number), as the pool reads them."""
    return cast(list[Message], [SimpleNamespace(queue_key=n, n=n, settled=False) for n in numbers])


def number(message: Message) -> int:
    return cast(int, cast(SimpleNamespace, message).n)


def test_callback_pool_runs_each_message_once_on_its_workers() -> None:
    """SUB-2: a released batch is handed to the workers in one go; each message runs once."""
    seen: list[int] = []
    lock = threading.Lock()

    def run(message: Message) -> None:
        with lock:
            seen.append(number(message))

    pool = CallbackPool("test-pool", 4, run)
    pool.submit(numbered(list(range(100))))
    pool.shutdown()
    assert sorted(seen) == list(range(100))


def test_a_keys_run_goes_on_one_worker_while_each_is_acked_and_the_rest_goes_back() -> None:
    """SUB-1, DLQ-3 (callback mode): a key's run of records is started one after another on one worker,
    each once the one before it is acked; after a nack (or a message left outstanding, or a
    partition gone) the rest goes back unstarted; other keys' messages run as usual."""
    started: list[tuple[str, int]] = []
    given_back: list[list[int]] = []

    def run(message: Message) -> None:
        started.append((threading.current_thread().name, number(message)))
        if number(message) != 12:
            cast(SimpleNamespace, message).settled = True  # acked; 12 is nacked (NACKED, not True)
        else:
            cast(SimpleNamespace, message).settled = 2

    def give_back(messages: list[Message]) -> None:
        given_back.append([number(m) for m in messages])

    pool = CallbackPool("test-pool", 4, run, Hooks(lambda message: True, give_back, lambda message: True))
    keyed = cast(list[Message], [SimpleNamespace(queue_key=b"k", n=n, settled=False) for n in (10, 11, 12, 13, 14)])
    pool.submit([*keyed, *numbered([20])])
    pool.shutdown()
    runs = [n for _, n in started]
    assert [n for n in runs if n != 20] == [10, 11, 12]
    assert len({name for name, n in started if n != 20}) == 1, "the run on one worker"
    assert 20 in runs and given_back == [[13, 14]]


def test_quick_callbacks_run_on_one_worker_and_waiting_messages_wake_more() -> None:
    """SUB-2: callbacks that return at once run on the one worker a hand-out wakes; a message that
    waits behind a callback held in user code gets another worker at the coordinator's next watch
    but one (it was queued at the previous one), so a slow callback does not hold the others."""
    threads: set[str] = set()
    held, entered = threading.Event(), threading.Event()
    ran: list[int] = []

    def run(message: Message) -> None:
        threads.add(threading.current_thread().name)
        if number(message) == -1:
            entered.set()
            held.wait(30)
        ran.append(number(message))

    pool = CallbackPool("test-pool", 4, run)

    def batch_ran(end: int) -> bool:
        return len(ran) == end and pool._idle == 4

    wait_until(lambda: pool._idle == 4, 10, "workers asleep")
    for end in range(100, 500, 100):
        threads.clear()
        pool.submit(numbered(list(range(end - 100, end))))
        wait_until(partial(batch_ran, end), 10, "the batch ran")
        assert len(threads) == 1  # the worker the hand-out woke
    assert sorted(ran) == list(range(400))
    threads.clear()
    pool.submit(numbered([-1, 7]))
    assert entered.wait(10)  # one worker held in user code, 7 waiting behind it
    assert pool.watch(0.0) == 0.0 + WATCH_INTERVAL  # queued since the last look: not overdue yet
    assert ran[-1] != 7
    assert pool.watch(1.0) is not None
    wait_until(lambda: ran[-1] == 7, 10, "7 ran beside the held callback")
    assert len(threads) == 2 and not held.is_set()  # 7 on another worker
    held.set()
    pool.shutdown()
    assert pool.watch(2.0) is None


def test_a_hand_out_wakes_a_worker_at_once_while_the_awake_ones_are_held() -> None:
    """SUB-2, prompt delivery: once the coordinator's look saw the one awake worker take nothing for
    ``HELD_AFTER`` (held in a slow callback), the next hand-out wakes another worker itself: its
    messages do not wait for a watch. Before that look, a hand-out leaves them to the awake worker."""
    held, entered = threading.Event(), threading.Event()
    ran: list[int] = []

    def run(message: Message) -> None:
        if number(message) == -1:
            entered.set()
            held.wait(30)
        ran.append(number(message))

    pool = CallbackPool("test-pool", 4, run)
    wait_until(lambda: pool._idle == 4, 10, "workers asleep")
    pool.submit(numbered([-1]))
    assert entered.wait(10)
    pool.watch(100.0)  # the worker took -1 since the last look: not held
    pool.watch(100.0 + HELD_AFTER / 2)
    pool.submit(numbered([1]))
    assert ran == [] and pool._idle == 3, "a worker taking messages lately is left to take them"
    pool.watch(100.0 + 2 * HELD_AFTER)  # still on -1: held
    pool.submit(numbered([2]))
    wait_until(lambda: sorted(ran) == [1, 2], 10, "1 and 2 ran beside the held callback, with no watch")
    held.set()
    pool.shutdown()
    assert ran[-1] == -1


def held(lease: int) -> bool:
    return True


def test_pulls_are_answered_oldest_first_and_expire_empty() -> None:
    """SUB-1 (pull mode): a release claims the oldest waiting pull, which gets that batch once it is
    handed out; a claimed pull does not time out meanwhile; an unclaimed one past its timeout gets []."""
    waiters = PullWaiters()
    first, second = Pull(5, 1.0, Future()), Pull(7, 2.0, Future())
    waiters.add(first, held)
    waiters.add(second, held)
    assert waiters.wanted() == (5, True) and waiters.next_deadline() == 1.0
    waiters.claim(1, True)
    assert waiters.wanted() == (7, True) and waiters.next_deadline() == 2.0  # the next release is the next pull's
    waiters.expire(1.5)
    assert not first.future.done()  # claimed: its batch is on its way
    batch = [message(0, b"a")]
    assert waiters.answer(batch, held) == []
    assert first.future.result() is batch
    waiters.expire(2.0)
    assert second.future.result() == [] and waiters.next_deadline() is None
    # None waits: the next release is ahead, AHEAD_AT_LEAST messages, the latest pull's size per key.
    assert waiters.wanted() == (AHEAD_AT_LEAST, False) and waiters.per_key() == 7


def test_a_claimed_pull_whose_batch_did_not_go_out_waits_again_first_in_line() -> None:
    """SUB-1 (pull mode): a batch given back (Redis failed) or screened out entirely leaves its pull
    waiting, ahead of the pulls that came after it; closing answers claimed pulls too."""
    waiters = PullWaiters()
    first, second = Pull(5, 10.0, Future()), Pull(7, 20.0, Future())
    waiters.add(first, held)
    waiters.add(second, held)
    waiters.claim(5, True)
    waiters.unclaim()
    assert waiters.wanted() == (5, True)
    waiters.claim(5, True)
    waiters.answer([], held)
    assert waiters.wanted() == (5, True) and not first.future.done()
    waiters.claim(5, True)
    waiters.close()
    assert first.future.result() == [] and second.future.result() == []


def message(offset: int, key: bytes, partition: int = 0) -> Message:
    """A released message as ``PullWaiters`` reads it: its queue key, partition and lease handle."""
    return cast(Message, SimpleNamespace(queue_key=key, lease=offset, record=SimpleNamespace(partition=partition),
                                         offset=offset))


def offsets(messages: list[Message]) -> list[int]:
    return [cast(SimpleNamespace, m).offset for m in messages]


def test_messages_released_ahead_answer_the_next_pull_at_once_in_whole_key_batches() -> None:
    """SUB-1, GRP-5 (pull mode): with no pull waiting, releases go ahead up to the latest pull's size;
    once out they wait ready, and a pull takes them at once: whole per-key batches in release order,
    no more than its size, so a key's batch is never split between two pulls; what it takes is kept
    for the coordinator to note their starts."""
    waiters = PullWaiters()
    waiters.add(Pull(4, 10.0, Future()), held)
    waiters.claim(4, True)
    waiters.answer([message(0, b"z")], held)
    assert waiters.wanted() == (AHEAD_AT_LEAST, False) and waiters.per_key() == 4
    waiters.claim(3, False)
    assert waiters.wanted() == (AHEAD_AT_LEAST - 3, False)  # 3 are on their way
    ahead = [message(1, b"a"), message(2, b"a"), message(3, b"b")]
    assert waiters.answer(ahead, held) == [] and waiters.wanted() == (AHEAD_AT_LEAST - 3, False)
    pull = Pull(2, 20.0, Future())
    assert waiters.add(pull, held) == []
    assert offsets(pull.future.result(0)) == [1, 2]  # key b's batch does not fit as well
    assert waiters.served == ahead[:2] and waiters.wanted() == (AHEAD_AT_LEAST - 1, False)
    second = Pull(5, 30.0, Future())
    waiters.add(second, held)
    assert offsets(second.future.result(0)) == [3] and waiters.served == ahead
    third = Pull(5, 40.0, Future())
    waiters.add(third, held)
    assert not third.future.done() and waiters.wanted() == (5, True)


def test_a_pull_waiting_when_a_release_ahead_comes_out_takes_it() -> None:
    """GRP-5: a pull that found nothing ready waits; the release ahead in flight answers it when its
    flush does; messages whose lease is gone (partition let go, lease lapsed) are not handed out."""
    waiters = PullWaiters()
    waiters.add(Pull(3, 10.0, Future()), held)
    waiters.claim(3, True)
    waiters.answer([message(0, b"z")], held)
    waiters.claim(3, False)
    pull = Pull(3, 20.0, Future())
    waiters.add(pull, held)
    assert waiters.wanted() == (3, True) and not pull.future.done()
    waiters.answer([message(1, b"a"), message(2, b"b"), message(3, b"c")], lambda lease: lease != 2)
    # The pull found nothing ready while a release ahead was on its way: the floor doubled.
    assert offsets(pull.future.result(0)) == [1, 3] and waiters.wanted() == (2 * AHEAD_AT_LEAST, False)


def test_pulls_that_outrun_the_refill_grow_what_is_kept_ahead_and_wake_the_coordinator_only_when_low() -> None:
    """GRP-5: a pull answered from what is ready wakes the coordinator only when fewer than half the
    messages to keep ahead are left; each pull that finds nothing ready while a release ahead is on
    its way doubles the floor, up to ``AHEAD_AT_MOST``."""
    waiters = PullWaiters()
    waiters.add(Pull(1, 10.0, Future()), held)
    assert waiters.refill()  # it waits
    waiters.claim(1, True)
    waiters.answer([message(0, b"z")], held)
    assert not waiters.refill() or waiters.wanted() == (AHEAD_AT_LEAST, False)
    waiters.claim(AHEAD_AT_LEAST, False)
    waiters.answer([message(n, f"k{n}".encode()) for n in range(1, AHEAD_AT_LEAST + 1)], held)
    for _ in range(AHEAD_AT_LEAST // 2 + 1):
        assert not waiters.refill()
        pull = Pull(1, 10.0, Future())
        waiters.add(pull, held)
        assert pull.future.done()
    assert waiters.refill()  # fewer than half of them left
    floors = []
    for _ in range(12):
        waiters.withdraw(None)
        waiters.claim(1, False)
        waiters.add(Pull(1, 10.0, Future()), held)  # nothing ready, a release ahead on its way
        waiters.expire(100.0)
        floors.append(waiters.wanted()[0] + 1)
        waiters.unclaim()
    assert floors[0] == 2 * AHEAD_AT_LEAST and floors[-1] == AHEAD_AT_MOST


def test_ready_messages_are_withdrawn_when_a_smaller_pull_comes_or_their_partition_goes() -> None:
    """SUB-1, SUB-5: a pull smaller than the first ready key batch would split it: everything ready is
    given back and the pull waits for a release of its own; a revoked partition's ready messages
    are given back and the others stay ready."""
    waiters = PullWaiters()
    waiters.add(Pull(3, 10.0, Future()), held)
    waiters.claim(3, True)
    waiters.answer([message(0, b"z")], held)
    waiters.claim(3, False)
    batch = [message(1, b"a"), message(2, b"a"), message(3, b"b", partition=1)]
    waiters.answer(batch, held)
    small = Pull(1, 20.0, Future())
    assert waiters.add(small, held) == batch
    assert waiters.wanted() == (1, True) and not small.future.done()
    waiters.claim(1, True)
    waiters.answer([message(4, b"c")], held)
    waiters.claim(1, False)
    waiters.answer(batch, held)
    assert waiters.withdraw([1]) == batch[2:]
    assert waiters.withdraw(None) == batch[:2] and waiters.withdraw(None) == []
