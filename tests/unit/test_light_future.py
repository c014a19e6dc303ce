"""LightFuture: the concurrent.futures.Future interface with a lazily made condition."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, InvalidStateError, as_completed, wait
from concurrent.futures import TimeoutError as FutureTimeout

import pytest

from ordering_layer.publisher.future import LightFuture


def test_is_a_running_future_that_cannot_be_cancelled() -> None:
    future: LightFuture[int] = LightFuture()
    assert isinstance(future, Future)
    assert future.running() and not future.done() and not future.cancelled()
    assert future.cancel() is False
    assert future.running()
    assert "state=running" in repr(future)
    with pytest.raises(RuntimeError):
        future.set_running_or_notify_cancel()


def test_result_and_exception() -> None:
    ok: LightFuture[int] = LightFuture()
    ok.set_result(7)
    assert ok.done() and not ok.running()
    assert ok.result() == 7 and ok.result(timeout=0) == 7
    assert ok.exception() is None
    assert "returned int" in repr(ok)

    failed: LightFuture[int] = LightFuture()
    error = ValueError("boom")
    failed.set_exception(error)
    assert failed.done()
    assert failed.exception() is error
    with pytest.raises(ValueError, match="boom"):
        failed.result()
    assert "raised ValueError" in repr(failed)


def test_completes_once() -> None:
    future: LightFuture[int] = LightFuture()
    future.set_result(1)
    with pytest.raises(InvalidStateError):
        future.set_result(2)
    with pytest.raises(InvalidStateError):
        future.set_exception(ValueError())
    assert future.result() == 1


def test_no_condition_until_someone_waits() -> None:
    future: LightFuture[int] = LightFuture()
    future.set_result(1)
    assert future.result() == 1 and future.exception() is None and future.done()
    assert future._cond is None
    pending: LightFuture[int] = LightFuture()
    with pytest.raises(FutureTimeout):
        pending.result(timeout=0.01)
    assert pending._cond is not None


def test_timeouts() -> None:
    future: LightFuture[int] = LightFuture()
    start = time.monotonic()
    with pytest.raises(FutureTimeout):
        future.result(timeout=0.05)
    with pytest.raises(FutureTimeout):
        future.exception(timeout=0.05)
    assert time.monotonic() - start >= 0.09
    future.set_result(3)
    assert future.result(timeout=0.05) == 3


def test_waiting_thread_is_woken() -> None:
    future: LightFuture[str] = LightFuture()
    got: list[str] = []
    waiter = threading.Thread(target=lambda: got.append(future.result(timeout=10)))
    waiter.start()
    time.sleep(0.05)
    future.set_result("done")
    waiter.join(10)
    assert got == ["done"]


def test_many_waiters_and_completions_race() -> None:
    """Completion without a lock against waiters that make the condition: nobody is left waiting."""
    def wait_for(future: LightFuture[int], got: list[int]) -> None:
        got.append(future.result(timeout=10))

    for _ in range(200):
        future: LightFuture[int] = LightFuture()
        got: list[int] = []
        waiters = [threading.Thread(target=wait_for, args=(future, got)) for _ in range(3)]
        for thread in waiters:
            thread.start()
        future.set_result(5)
        for thread in waiters:
            thread.join(10)
        assert got == [5, 5, 5]


def test_done_callbacks() -> None:
    future: LightFuture[int] = LightFuture()
    calls: list[tuple[str, int]] = []
    future.add_done_callback(lambda f: calls.append(("first", f.result())))
    future.add_done_callback(lambda f: 1 / 0)  # logged, does not stop the others
    future.add_done_callback(lambda f: calls.append(("second", f.result())))
    assert calls == []
    future.set_result(9)
    assert calls == [("first", 9), ("second", 9)]
    future.add_done_callback(lambda f: calls.append(("late", f.result())))  # at once when done
    assert calls[-1] == ("late", 9)


def test_done_callback_on_failure() -> None:
    future: LightFuture[int] = LightFuture()
    seen: list[BaseException | None] = []
    future.add_done_callback(lambda f: seen.append(f.exception()))
    error = KeyError("k")
    future.set_exception(error)
    assert seen == [error]


def test_concurrent_futures_wait_and_as_completed() -> None:
    futures: list[LightFuture[int]] = [LightFuture() for _ in range(4)]
    futures[0].set_result(0)
    done, not_done = wait(futures, timeout=0.01, return_when=ALL_COMPLETED)
    assert done == {futures[0]} and len(not_done) == 3

    def finish() -> None:
        time.sleep(0.05)
        futures[1].set_exception(ValueError("x"))
        futures[2].set_result(2)
        futures[3].set_result(3)

    threading.Thread(target=finish).start()
    done, not_done = wait(futures[1:], timeout=10, return_when=FIRST_COMPLETED)
    assert futures[1] in done
    done, not_done = wait(futures, timeout=10)
    assert not not_done
    assert {f.exception() is None for f in as_completed(futures, timeout=10)} == {True, False}


def test_as_completed_wakes_on_later_completion() -> None:
    futures: list[LightFuture[int]] = [LightFuture() for _ in range(3)]
    def finish() -> None:
        for n, future in enumerate(futures):
            future.set_result(n)

    timer = threading.Timer(0.05, finish)
    timer.start()
    assert sorted(f.result() for f in as_completed(futures, timeout=10)) == [0, 1, 2]
    timer.join()
