"""Where callbacks run besides the subscriber's own thread pool (SUB-9).

``handoff_for`` picks the hand-off of a callback subscription: ``CallbackPool`` (threads, the
default), ``LoopCallbacks`` (a coroutine function, awaited on an event loop the subscriber runs in a
thread of its own), ``ExecutorCallbacks`` (any ``concurrent.futures.Executor`` running callables in
this process, such as a ``ThreadPoolExecutor``) or ``ProcessCallbacks`` (``processes``: a
``ProcessPoolExecutor``, the callback on a picklable copy of each message).

Every hand-out keeps ``CallbackPool``'s rule for a key's run (``runs``). So no two messages of one
key are in user code at once (SUB-1).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from typing import TYPE_CHECKING, Any, Protocol, cast

from ordering_layer.errors import ConfigError
from ordering_layer.subscriber.handoff import CallbackPool
from ordering_layer.subscriber.message import Message
from ordering_layer.subscriber.processes import ProcessCallbacks
from ordering_layer.subscriber.runs import Hooks, Item, goes_on, items_of, run_item

if TYPE_CHECKING:
    from ordering_layer.subscriber.delivery_tracing import DeliveryTracing
    from ordering_layer.subscriber.processes import MessageCopy

_LOGGER = logging.getLogger(__name__)

# What ``subscribe`` takes: a function or coroutine function of a ``Message``, or, for worker
# processes, a function of a ``MessageCopy``.
Callback = Callable[["Message"], Any] | Callable[["MessageCopy"], Any]


class Handoff(Protocol):
    """What the engine hands released messages to in callback mode."""

    def submit(self, messages: list[Message]) -> None: ...

    def watch(self, now: float) -> float | None: ...

    def shutdown(self) -> None: ...


class ExecutorCallbacks:
    """Each released item becomes one task of the user's executor, run in this process (threads):
    the callback gets the ``Message`` itself, as with the default pool. The executor stays the user's:
    ``shutdown`` waits for the tasks given to it, and does not shut it down."""

    def __init__(self, executor: Executor, run: Callable[[Message], None], hooks: Hooks) -> None:
        self._executor = executor
        self._run = run
        self._hooks = hooks
        self._lock = threading.Lock()
        self._tasks: set[Future[None]] = set()

    def submit(self, messages: list[Message]) -> None:
        for item in items_of(messages):
            try:
                task = self._executor.submit(run_item, item, self._run, self._hooks)
            except RuntimeError as exc:  # the executor was shut down: the messages go back unstarted
                _LOGGER.error("the executor refused a callback (%r); giving its messages back", exc)
                self._hooks.give_back(item if isinstance(item, list) else [item])
                continue
            with self._lock:
                self._tasks.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: Future[None]) -> None:
        with self._lock:
            self._tasks.discard(task)
        if task.exception() is not None:
            _LOGGER.error("a callback task failed: %r", task.exception())

    def watch(self, now: float) -> float | None:
        return None

    def shutdown(self) -> None:
        with self._lock:
            tasks = list(self._tasks)
        wait_all(tasks)


class LoopCallbacks:
    """Coroutine callbacks awaited on an event loop: every released item is a task, so as many keys
    are in user code at once as flow control lets out. The loop is the caller's (``loop``: running
    in a thread of theirs, left running at ``shutdown``) or one run by a thread of its own. A
    suspect's start (a Redis write, ``Engine.begin``) is made on a small thread pool, off the loop;
    other starts are at most a note in a list, made on the loop."""

    def __init__(self, name: str, callback: Callable[[Message], Awaitable[Any]], hooks: Hooks,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._callback = callback
        self._hooks = hooks
        self.loop = loop or asyncio.new_event_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        self._begins = ThreadPoolExecutor(2, thread_name_prefix=f"{name}-begin")
        self._thread: threading.Thread | None = None
        if loop is None:
            self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, messages: list[Message]) -> None:
        self.loop.call_soon_threadsafe(self._start, items_of(messages))

    def _start(self, items: list[Item]) -> None:
        tasks, create = self._tasks, self.loop.create_task
        for item in items:
            task = create(self._item(item))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    def _item(self, item: Item) -> Coroutine[Any, Any, None]:
        """The coroutine that runs one released item: a message, or a key's run."""
        return self._one(item) if isinstance(item, Message) else self._run(item)

    async def _one(self, message: Message) -> None:
        if message.suspect:
            if not await self.loop.run_in_executor(self._begins, self._hooks.begin, message):
                return
        elif not self._hooks.begin(message):
            return
        try:
            await self._callback(message)
        except Exception as exc:  # noqa: BLE001 - user code; its failure is a nack
            _LOGGER.warning("callback failed on %r: %r; nacking", message, exc)
            message.nack(error=repr(exc))

    async def _run(self, run: list[Message]) -> None:
        hooks = self._hooks
        began = time.monotonic()
        await self._one(run[0])
        for index in range(1, len(run)):
            if not goes_on(run[index - 1], began, run[index], hooks):
                hooks.give_back(run[index:])
                return
            await self._one(run[index])

    def watch(self, now: float) -> float | None:
        return None

    def shutdown(self) -> None:
        """Let the running coroutines finish, then stop the loop and its thread (not a loop of the
        caller's)."""
        asyncio.run_coroutine_threadsafe(self._drain(), self.loop).result()
        if self._thread is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
            self.loop.close()
        self._begins.shutdown()

    async def _drain(self) -> None:
        while self._tasks:
            await asyncio.wait(list(self._tasks))


def traced_coroutine(tracing: DeliveryTracing,
                     callback: Callable[[Message], Awaitable[Any]]) -> Callable[[Message], Coroutine[Any, Any, None]]:
    """A coroutine callback run inside each message's delivery span (``DeliveryTracing.wrap``'s
    counterpart: the span's context is current in the callback's task while it runs)."""

    async def traced(message: Message) -> None:
        settling = tracing.deliver(message)
        token = tracing._attach(settling.context)
        try:
            await callback(message)
        except Exception as exc:
            settling.failed(exc)
            raise
        finally:
            tracing._detach(token)

    return traced


class AsyncWorkers:
    """``subscribe(..., executor=AsyncWorkers(loop, workers))``: a coroutine callback awaited by
    ``workers`` coroutines on ``loop`` (running in a thread of yours), each taking the next released
    message once its callback returns. At most ``workers`` callbacks run at once, and a message costs
    no task of its own: for a callback bound by a limit of its own (requests to a service), where
    ``executor=loop`` would start one task per message that flow control lets out. ``waiting``: the
    messages released and not yet taken by a worker. One subscription per ``AsyncWorkers``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, workers: int) -> None:
        if workers < 1:
            raise ConfigError(f"AsyncWorkers: workers must be at least 1, not {workers}")
        self.loop = loop
        self.workers = workers
        self._queue: deque[Item] | None = None

    @property
    def waiting(self) -> int:
        """Messages released to the workers and not yet taken by one (0 before ``subscribe``)."""
        return 0 if self._queue is None else len(self._queue)

    def _bind(self, queue: deque[Item]) -> None:
        if self._queue is not None:
            raise ConfigError("an AsyncWorkers serves one subscription; make one per subscribe()")
        self._queue = queue


class LoopWorkers(LoopCallbacks):
    """``AsyncWorkers``' hand-off: released items wait in a queue, taken in order by a fixed number
    of worker coroutines on the loop; a key's run is one item, run by one worker (``_run``)."""

    def __init__(self, name: str, callback: Callable[[Message], Awaitable[Any]], hooks: Hooks,
                 spec: AsyncWorkers) -> None:
        super().__init__(name, callback, hooks, loop=spec.loop)
        self._queue: deque[Item] = deque()
        self._idle: deque[asyncio.Future[None]] = deque()
        self._stopping = False
        spec._bind(self._queue)
        self.loop.call_soon_threadsafe(self._spawn, spec.workers)  # before any item: the loop's calls run in order

    def _spawn(self, workers: int) -> None:
        for _ in range(workers):
            task = self.loop.create_task(self._work())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _start(self, items: list[Item]) -> None:
        self._queue.extend(items)
        idle = self._idle
        for _ in range(min(len(items), len(idle))):
            idle.popleft().set_result(None)

    async def _work(self) -> None:
        queue, idle, loop = self._queue, self._idle, self.loop
        while True:
            if queue:
                item = queue.popleft()
                await self._item(item)
            elif self._stopping:
                return
            else:
                waiter = loop.create_future()
                idle.append(waiter)
                await waiter

    async def _drain(self) -> None:
        """The workers run what is queued, then end."""
        self._stopping = True
        while self._idle:
            self._idle.popleft().set_result(None)
        await super()._drain()


def handoff_for(name: str, callback: Callback, *, executor: Executor | asyncio.AbstractEventLoop | AsyncWorkers | None,
                max_workers: int, run: Callable[[Message], None], hooks: Hooks,
                tracing: DeliveryTracing | None) -> Handoff:
    """The hand-out of a callback subscription: an event loop for a coroutine function (the given
    one, running, or the subscriber's own), the given executor, or the default thread pool of
    ``max_workers``. ``run`` runs user code on a message in this process (start, callback, nack on
    failure)."""
    workers = executor if isinstance(executor, AsyncWorkers) else None
    if workers is not None:
        loop: asyncio.AbstractEventLoop | None = workers.loop
    else:
        loop = executor if isinstance(executor, asyncio.AbstractEventLoop) else None
    if inspect.iscoroutinefunction(callback):
        if executor is not None and loop is None:
            raise ConfigError("a coroutine function runs on an event loop (the subscriber's, or one given as "
                              "executor=); a concurrent.futures executor is for plain functions")
        if loop is not None and not loop.is_running():
            raise ConfigError("executor=: the event loop is not running (run it in a thread of yours first)")
        coroutine = cast(Callable[[Message], Awaitable[Any]], callback)
        handler = coroutine if tracing is None else traced_coroutine(tracing, coroutine)
        if workers is not None:
            return LoopWorkers(name, handler, hooks, workers)
        return LoopCallbacks(name, handler, hooks, loop=loop)
    if loop is not None:
        raise ConfigError("an event loop as executor= awaits a coroutine function (async def); this callback "
                          "is a plain function")
    if isinstance(executor, ProcessPoolExecutor):
        if tracing is not None:
            _LOGGER.warning("%s: delivery spans are not made for callbacks run in worker processes", name)
        return ProcessCallbacks(name, executor, callback, hooks)
    if executor is not None:  # any executor of callables in this process (a loop was refused above)
        return ExecutorCallbacks(cast(Executor, executor), run, hooks)
    return CallbackPool(name, max_workers, run, hooks)
