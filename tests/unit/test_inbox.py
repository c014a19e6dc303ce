"""The engine's inbox: posts from many threads, batched take, wake-ups only when armed."""

from __future__ import annotations

import socket
import threading
import time

from ordering_layer.subscriber.inbox import Inbox


def test_take_returns_everything_in_order() -> None:
    """Events come out oldest first, all at once."""
    inbox: Inbox[int] = Inbox()
    for n in range(5):
        inbox.put(n)
    assert len(inbox) == 5
    assert inbox.take() == [0, 1, 2, 3, 4]
    assert inbox.take() == []


def test_wait_returns_at_once_when_enough_is_waiting_and_times_out_otherwise() -> None:
    """A consumer asking for more than is waiting sleeps until the timeout."""
    inbox: Inbox[int] = Inbox()
    inbox.put(1)
    assert inbox.wait(1, 10.0)
    started = time.monotonic()
    assert not inbox.wait(2, 0.05)
    assert time.monotonic() - started >= 0.04


def test_a_post_wakes_a_waiting_consumer_only_at_the_armed_length() -> None:
    """An idle consumer is woken by the first post; a gathering one by the n-th, not before."""
    inbox: Inbox[int] = Inbox()
    woke = threading.Event()

    def consumer() -> None:
        inbox.wait(3, 10.0)
        woke.set()

    thread = threading.Thread(target=consumer)
    thread.start()
    time.sleep(0.05)
    inbox.put(1)
    inbox.put(2)
    assert not woke.wait(0.1)
    inbox.put(3)
    assert woke.wait(5.0)
    thread.join()


def test_no_post_is_lost_between_many_posters_and_the_consumer() -> None:
    """Posts racing the consumer's sleep are all taken, and the consumer never sleeps past one."""
    inbox: Inbox[int] = Inbox()
    posters, per_poster = 4, 5000
    got: list[int] = []

    def post(base: int) -> None:
        for n in range(per_poster):
            inbox.put(base + n)

    threads = [threading.Thread(target=post, args=(p * per_poster,)) for p in range(posters)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30.0
    while len(got) < posters * per_poster and time.monotonic() < deadline:
        assert inbox.wait(1, 5.0) or len(got) == posters * per_poster
        got.extend(inbox.take())
    for thread in threads:
        thread.join()
    assert sorted(got) == list(range(posters * per_poster))


def test_a_burst_of_posts_wakes_a_waiting_consumer_once() -> None:
    """The post that wakes an idle consumer disarms the wake-up: the 99 posts after it, made before
    the consumer runs again, send no wake-up (each is a system call)."""
    inbox: Inbox[int] = Inbox()
    signals = 0
    signal = inbox._signal

    def counted() -> None:
        nonlocal signals
        signals += 1
        signal()

    inbox._signal = counted  # type: ignore[method-assign]
    taken: list[int] = []
    thread = threading.Thread(target=lambda: taken.extend(inbox.take() if inbox.wait(1, 10.0) else []))
    thread.start()
    deadline = time.monotonic() + 10.0
    while inbox._wake_at != 1:
        assert time.monotonic() < deadline, "the consumer did not arm its wake-up"
        time.sleep(0.001)
    for n in range(100):
        inbox.put(n)
    thread.join(10.0)
    assert signals == 1
    assert taken + inbox.take() == list(range(100))


def test_a_nudge_ends_any_wait_until_the_next_take() -> None:
    """An answer the consumer awaits (a flush in flight) wakes it at once, also while it gathers a batch
    (waits for many events) and also when the nudge came before the wait; ``take`` clears it."""
    inbox: Inbox[int] = Inbox()
    inbox.nudge()
    start = time.monotonic()
    assert inbox.wait(500, 10.0) and time.monotonic() - start < 5.0
    assert inbox.take() == []
    assert not inbox.wait(1, 0.0)
    inbox.put(1)
    done = threading.Event()

    def gather() -> None:
        inbox.wait(500, 10.0)
        done.set()

    thread = threading.Thread(target=gather)
    thread.start()
    deadline = time.monotonic() + 10.0
    while inbox._wake_at != 500:
        assert time.monotonic() < deadline, "the consumer did not arm its wake-up"
        time.sleep(0.001)
    inbox.nudge()
    assert done.wait(5.0)
    thread.join(10.0)
    assert inbox.take() == [1]


def test_a_socket_with_something_to_read_ends_a_wait() -> None:
    """The consumer waits for its events and for a socket of its own (a flush's answer) at once."""
    inbox: Inbox[int] = Inbox()
    left, right = socket.socketpair()
    with left, right:
        started = time.monotonic()
        assert not inbox.wait(1, 0.05, left) and time.monotonic() - started >= 0.04
        done = threading.Event()

        def wait() -> None:
            if inbox.wait(500, 10.0, left):
                done.set()

        thread = threading.Thread(target=wait)
        thread.start()
        right.send(b"+1\r\n")
        assert done.wait(5.0)
        thread.join(10.0)
        assert inbox.take() == []
        left.close()
        assert inbox.wait(1, 10.0, left)  # closed meanwhile: its reader finds out at once
