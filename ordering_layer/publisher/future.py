"""``LightFuture``: a ``concurrent.futures.Future`` that builds its lock only when a thread waits.

A publish hands back one future per message, and at a few microseconds per message the standard
``Future`` (a ``Condition`` with its ``RLock``, two lists) costs as much as the send itself, and its
eight objects per message make the garbage collector's work grow with the number of futures kept.
A ``LightFuture`` is one object with slots until someone waits, adds a callback, or calls
``concurrent.futures.wait``/``as_completed`` on it; the ``Condition`` is made then.

It represents work already under way: it starts ``running`` and cannot be cancelled (``cancel()``
returns False), like a ``Future`` whose executor has started it. It is meant to be completed once,
by one thread (``set_result``/``set_exception``; a second completion raises ``InvalidStateError``).

Completing without a lock is safe under the GIL because both sides write before they read: the
completing thread sets the state, then looks for a condition; a waiting thread publishes the
condition, then (holding it) reads the state. One of them sees the other's write.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, TimeoutError
from concurrent.futures._base import FINISHED, RUNNING
from typing import Any, TypeVar

__all__ = ["FINISHED", "RUNNING", "LightFuture"]

_LOGGER = logging.getLogger(__name__)
_CREATE = threading.Lock()

T = TypeVar("T")


class LightFuture(Future[T]):
    """A ``Future`` of work under way, cheap to make and to complete; see the module doc."""

    # Future's attributes, shadowed so that Future.__init__ need not run. _state is a slot (set by
    # every future); the rest are class-level defaults until set, which puts them in the
    # instance's __dict__ (Future has no __slots__). concurrent.futures.wait and as_completed read
    # _state, _condition and _waiters, so they work on a LightFuture.
    __slots__ = ("_state",)
    _result: T | None = None
    _exception: BaseException | None = None
    _cond: threading.Condition | None = None
    _waiter_list: list[Any] | None = None
    _done_callbacks: list[Callable[[Future[T]], object]] | None = None

    def __init__(self) -> None:  # Future.__init__ would build the Condition eagerly
        self._state = RUNNING

    # -- lazy synchronisation (what Future's own methods and concurrent.futures.wait use) --------
    @property
    def _condition(self) -> threading.Condition:
        cond = self._cond
        if cond is None:
            with _CREATE:
                cond = self._cond
                if cond is None:
                    cond = threading.Condition()
                    self._waiter_list = []
                    self._cond = cond
        return cond

    @_condition.setter
    def _condition(self, value: threading.Condition) -> None:
        raise AttributeError("LightFuture makes its condition itself")

    @property
    def _waiters(self) -> list[Any]:
        self._condition  # noqa: B018 -- makes the list with the condition
        assert self._waiter_list is not None
        return self._waiter_list

    @_waiters.setter
    def _waiters(self, value: list[Any]) -> None:
        raise AttributeError("LightFuture makes its waiter list itself")

    # -- completing ------------------------------------------------------------------------------
    def _value(self) -> T:
        """The result once finished without an exception; subclasses may build it lazily."""
        return self._result  # type: ignore[return-value]

    def _complete(self) -> None:
        """Mark finished (result or exception already stored), wake waiters, run callbacks."""
        if self._state == FINISHED:
            raise InvalidStateError(f"{self!r} is finished already")
        self._state = FINISHED  # first write the state, then look for a condition (module doc)
        cond = self._cond
        if cond is not None:
            self._wake(cond)

    def _wake(self, cond: threading.Condition) -> None:
        """After finishing: wake waiting threads and ``wait()``/``as_completed()``, run callbacks."""
        with cond:
            if self._waiter_list:
                for waiter in self._waiter_list:
                    if self._exception is None:
                        waiter.add_result(self)
                    else:
                        waiter.add_exception(self)
            cond.notify_all()
            callbacks, self._done_callbacks = self._done_callbacks, None
        if callbacks:
            for callback in callbacks:
                self._call(callback)

    def set_result(self, result: T) -> None:
        """Complete with ``result`` (once)."""
        if self._state == FINISHED:
            raise InvalidStateError(f"{self!r} is finished already")
        self._result = result
        self._complete()

    def set_exception(self, exception: BaseException | None) -> None:
        """Complete with ``exception`` (once)."""
        if self._state == FINISHED:
            raise InvalidStateError(f"{self!r} is finished already")
        self._exception = exception
        self._complete()

    def set_running_or_notify_cancel(self) -> bool:
        """A ``LightFuture`` is running from the start: there is nothing to mark."""
        raise RuntimeError("LightFuture is running from the start")

    # -- the Future interface --------------------------------------------------------------------
    def cancel(self) -> bool:
        """Work under way cannot be cancelled: always False."""
        return False

    def cancelled(self) -> bool:
        """Always False (see ``cancel``)."""
        return False

    def running(self) -> bool:
        """True until finished."""
        return self._state == RUNNING

    def done(self) -> bool:
        """True once finished."""
        return self._state == FINISHED

    def _wait(self, timeout: float | None) -> None:
        cond = self._condition
        with cond:
            if not cond.wait_for(self.done, timeout):
                raise TimeoutError()

    def result(self, timeout: float | None = None) -> T:
        """The result, waiting up to ``timeout`` seconds; raises the exception if it failed."""
        if self._state != FINISHED:
            self._wait(timeout)
        exception = self._exception
        if exception is not None:
            try:
                raise exception
            finally:
                del exception, self  # no exception -> traceback -> frame -> exception cycle
        return self._value()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The exception (None on success), waiting up to ``timeout`` seconds."""
        if self._state != FINISHED:
            self._wait(timeout)
        return self._exception

    def add_done_callback(self, fn: Callable[[Future[T]], object]) -> None:
        """Call ``fn(self)`` when finished (at once, in this thread, if finished already)."""
        if self._state != FINISHED:
            with self._condition:
                if self._state != FINISHED:
                    if self._done_callbacks is None:
                        self._done_callbacks = []
                    self._done_callbacks.append(fn)
                    return
        self._call(fn)

    def _call(self, callback: Callable[[Future[T]], object]) -> None:
        try:
            callback(self)
        except Exception:
            _LOGGER.exception("exception calling callback for %r", self)

    def __repr__(self) -> str:
        name = f"<{type(self).__name__} at {id(self):#x}"
        if self._state != FINISHED:
            return f"{name} state=running>"
        if self._exception is not None:
            return f"{name} state=finished raised {type(self._exception).__name__}>"
        return f"{name} state=finished returned {type(self._value()).__name__}>"
