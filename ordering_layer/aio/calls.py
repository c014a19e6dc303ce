"""What the asyncio wrappers share: the sync client's calls on an executor, its callbacks on the loop.

The sync clients (``OrderedProducer``, ``OrderedConsumer``, ``Subscriber``) reach Kafka and Redis on
the calling thread, so, as ``confluent_kafka.aio`` does with its sync clients, every call of theirs
runs on a ``concurrent.futures.Executor`` and the coroutine awaits it; the event loop never blocks.

- ``Lazy``: a sync client is made on the executor at its first use (its constructor checks the
  credentials against Kafka and Redis), once; a failed attempt is tried again by the next use.
- ``CallGate``: runs calls on the executor. A *serial* call waits for the one before it (the
  consumer's auto-commit acks at each ``poll`` what the previous one returned, so two may not
  overlap), except a call made from one of the client's own callbacks, which is admitted at once as
  ``confluent_kafka.aio`` admits it (the callback runs while a call of the same client may wait on
  it). A call whose awaiting coroutine is cancelled goes on in its thread; the messages it returns
  then are given back (nacked, so they are delivered again: SUB-3) before the next serial call runs.
- ``on_loop``: a callback of the program (``async def`` as ``confluent_kafka.aio`` wants it, or a
  plain function) made into one the sync client calls on its own threads: it runs on the event loop
  and the calling thread waits for it. Its exceptions are logged, never raised into the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from contextvars import ContextVar
from typing import Any, Generic, TypeVar

from ordering_layer.subscriber import Message

_LOGGER = logging.getLogger(__name__)

T = TypeVar("T")

# The conf callbacks confluent_kafka.aio runs on the event loop (the consumer adds on_commit).
COMMON_CALLBACKS = ("error_cb", "throttle_cb", "stats_cb")
_CANCELLED = "the coroutine awaiting the message was cancelled"
_LOOP_CHECK = 1.0  # seconds between checks that the loop still runs, while a callback waits for it

# The gate whose client's callback is running in this task (its calls are admitted at once).
_IN_CALLBACK: ContextVar[CallGate | None] = ContextVar("ordering_layer_aio_callback", default=None)


def given_back(messages: Iterable[Message]) -> None:
    """Nack the messages an abandoned call received and nobody saw (delivered again, SUB-3/SUB-4)."""
    for message in messages:
        if not message.settled:
            message.nack(error=_CANCELLED)


class CallGate:
    """Runs the calls of one sync client on ``executor`` for coroutines on ``loop`` (see module doc).

    Args:
        loop: the event loop of the coroutines (the running one when the wrapper was made).
        executor: where the blocking calls run.
        owns_executor: ``shutdown`` shuts the executor down (the wrapper made it).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, executor: Executor, *, owns_executor: bool) -> None:
        self.loop = loop
        self.executor = executor
        self._owns_executor = owns_executor
        self._serial = asyncio.Lock()
        self._loop_thread = threading.get_ident()
        self._background: set[asyncio.Future[Any]] = set()

    @classmethod
    def made(cls, executor: Executor | None, max_workers: int, name: str) -> CallGate:
        """A gate on the running loop, on ``executor`` or on a pool of ``max_workers`` threads it owns.

        Raises:
            RuntimeError: no event loop runs in this thread (as ``confluent_kafka.aio``).
            ValueError: ``max_workers`` below 1.
        """
        loop = asyncio.get_running_loop()
        if executor is not None:
            return cls(loop, executor, owns_executor=False)
        if max_workers < 1:
            raise ValueError("max_workers must be at least 1")
        return cls(loop, ThreadPoolExecutor(max_workers, thread_name_prefix=name), owns_executor=True)

    async def call(self, fn: Callable[[], T], *, serial: bool = False,
                   given: Callable[[T], Iterable[Message]] | None = None) -> T:
        """Run ``fn()`` on the executor and return what it returns (or raise what it raises).

        ``serial``: after the serial call before it has finished (unless called from a callback of
        this client). ``given``: the messages in ``fn``'s result, nacked when the awaiting coroutine
        is cancelled before it got them.
        """
        locked = serial and _IN_CALLBACK.get() is not self
        if locked:
            await self._serial.acquire()
        try:
            future = self.executor.submit(fn)
        except BaseException:
            if locked:
                self._serial.release()
            raise
        try:
            result = await asyncio.wrap_future(future, loop=self.loop)
        except asyncio.CancelledError:
            # The thread goes on (or never starts: then the future is cancelled). The serial lock
            # is let go only after what it returns has been given back.
            future.add_done_callback(functools.partial(self._abandoned, given, locked))
            raise
        except BaseException:
            if locked:
                self._serial.release()
            raise
        if locked:
            self._serial.release()
        return result

    def _abandoned(self, given: Callable[[T], Iterable[Message]] | None, locked: bool, future: Future[T]) -> None:
        """A call nobody awaits any more has ended (on its thread, or on the loop's if it had already)."""
        if given is not None and not future.cancelled() and future.exception() is None:
            given_back(given(future.result()))
        if locked:
            self.soon(self._serial.release)

    def soon(self, fn: Callable[..., None], *args: Any) -> None:
        """Call ``fn(*args)`` on the loop's thread (at once when on it); dropped once the loop closed."""
        if self.on_loop_thread():
            fn(*args)
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to tell
            self.loop.call_soon_threadsafe(fn, *args)

    def background(self, awaitable: Awaitable[Any]) -> None:
        """Run ``awaitable`` on the loop without waiting for it (kept referenced until it ends)."""
        task = asyncio.ensure_future(awaitable, loop=self.loop)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def on_loop_thread(self) -> bool:
        """Whether the caller runs on the loop's thread."""
        return threading.get_ident() == self._loop_thread

    async def shutdown(self) -> None:
        """Shut down the executor when the gate made it (waiting, off the loop, for its threads)."""
        if self._owns_executor:
            await self.loop.run_in_executor(None, functools.partial(self.executor.shutdown, wait=True))


class Lazy(Generic[T]):
    """A sync client made on the gate's executor at its first use (see module doc)."""

    def __init__(self, gate: CallGate, make: Callable[[], T]) -> None:
        self._gate = gate
        self._make = make
        self._making: asyncio.Future[T] | None = None
        self.value: T | None = None  # the client, once made

    async def get(self) -> T:
        """The client, made now if it is not yet (concurrent first uses share one attempt).

        Raises:
            Exception: what the client's constructor raised (``ConfigError``, ``AuthenticationError``).
        """
        if self.value is not None:
            return self.value
        if self._making is None:
            self._making = asyncio.ensure_future(self._gate.call(self._make))
        making = self._making
        try:
            # Shielded: a cancelled first user does not cancel the attempt the others wait for.
            self.value = await asyncio.shield(making)
        except Exception:
            if self._making is making:
                self._making = None  # the next use tries again
            raise
        return self.value


def on_loop(gate: CallGate, callback: Callable[..., Any], name: str,
            first: object | None = None) -> Callable[..., None]:
    """``callback`` as a function the sync client calls on its own threads (see module doc).

    Args:
        gate: the client's gate; calls the callback makes are admitted at once.
        callback: a coroutine function or a plain function.
        name: what it is (for the log of its failures).
        first: replaces the first argument (the sync client of a rebalance callback) when given.
    """

    async def run(args: tuple[Any, ...]) -> None:
        _IN_CALLBACK.set(gate)  # this task's own context: seen by the calls it awaits
        result = callback(*args)
        if inspect.isawaitable(result):
            await result

    def called(*args: Any) -> None:
        if first is not None:
            args = (first, *args[1:])
        if gate.on_loop_thread():  # not by the sync clients; never wait on ourselves
            gate.background(run(args))
            return
        try:
            future = asyncio.run_coroutine_threadsafe(run(args), gate.loop)
        except RuntimeError:
            _LOGGER.warning("%s not called: the event loop is closed", name)
            return
        while not wait([future], _LOOP_CHECK).done:
            if not gate.loop.is_running():
                future.cancel()
                _LOGGER.warning("%s not finished: the event loop stopped", name)
                return
        failure = None if future.cancelled() else future.exception()
        if failure is not None:  # the program's callback; the client goes on
            _LOGGER.error("%s raised", name, exc_info=failure)

    return called


def callbacks_on_loop(gate: CallGate, conf: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """A copy of ``conf`` whose callbacks named ``names`` run on the loop (``on_loop``)."""
    copied = dict(conf)
    for name in names:
        callback = copied.get(name)
        if callable(callback):
            copied[name] = on_loop(gate, callback, name)
    return copied
