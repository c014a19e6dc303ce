"""Callbacks in worker processes (SUB-9): a ``ProcessPoolExecutor`` runs a picklable top-level
callback on ``MessageCopy``, a picklable copy of each message; returning acks, raising (or
``nack()`` on the copy) nacks.

One driver thread starts tasks, at most two per process of the pool at a time (one a process runs,
one next in line: a process finds its next task waiting instead of idling through the round trip to
the driver, whose threads share the interpreter lock with the subscriber's), and settles their
messages as the tasks complete. A task is one message, or, when more wait than twice the tasks
running, up to ``BATCH_MAX`` messages of different keys that one process runs one after another
(fewer round trips per message; each is acked or nacked when its task returns). A key's run goes
on as ``CallbackPool``'s does (``goes_on``): its next message joins a later task once the one
before it is acked.

A worker process that dies breaks the pool: every message of the tasks the pool held is nacked
(its attempt counts, ACK-6, DLQ-3), and a new pool with the same settings replaces it. Which message
killed the process is not known, so the messages nacked by a break (the *casualties*) each run alone
when they come again: a poison that kills its process then takes down no other message, and is
dead-lettered after exactly ``max_delivery_attempts``; a message that was in a task beside it is
charged one attempt.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from datetime import datetime
from typing import Any

from ordering_layer.errors import ConfigError
from ordering_layer.record import HeaderPairs
from ordering_layer.subscriber.message import Message
from ordering_layer.subscriber.runs import Hooks, goes_on, items_of

_LOGGER = logging.getLogger(__name__)
_CASUALTIES_MAX = 10_000  # casualties remembered at most (one that never comes back here is dropped)
BATCH_MAX = 4  # messages of one task at most (run one after another by one process)


class MessageCopy:
    """A picklable copy of a ``Message`` for a callback in a worker process: the Pub/Sub fields
    (``data``, ``attributes``, ``ordering_key``, ``message_id``, ``sequence_number``,
    ``publish_time`` (also ``enqueued_time``), ``delivery_attempt``) and confluent-kafka's accessors
    (``key()``, ``value()``, ``headers()``, ``topic()``, ``partition()``, ``offset()``). ``ack()``
    does nothing (returning acks); ``nack()`` makes the message nacked once the callback returns."""

    __slots__ = ("_headers", "_key", "_offset", "_partition", "_topic", "attributes", "data", "delivery_attempt",
                 "message_id", "nacked", "ordering_key", "publish_time", "sequence_number")

    def __init__(self, message: Message) -> None:
        record = message.record
        self.data = message.data
        self.attributes = message.attributes
        self.ordering_key = message.ordering_key
        self.message_id = message.message_id
        self.sequence_number = message.sequence_number
        self.publish_time: datetime = message.enqueued_time
        self.delivery_attempt = message.delivery_attempt
        self.nacked = False
        self._key, self._headers = record.key, message.headers()
        self._topic, self._partition, self._offset = message.topic(), record.partition, record.offset

    @property
    def enqueued_time(self) -> datetime:
        """The broker's append time (as ``Message.enqueued_time``)."""
        return self.publish_time

    def ack(self) -> None:
        """Nothing to do: the message is acked when the callback returns."""

    def nack(self) -> None:
        """Nack the message once the callback returns (as raising would)."""
        self.nacked = True

    def key(self) -> bytes | None:
        return self._key

    def value(self) -> bytes:
        return self.data

    def headers(self) -> HeaderPairs | None:
        return self._headers

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def __repr__(self) -> str:
        return (f"MessageCopy(ordering_key={self.ordering_key!r}, message_id={self.message_id!r}, "
                f"delivery_attempt={self.delivery_attempt}, pid={os.getpid()})")


def invoke(callback: Callable[[MessageCopy], Any], messages: list[MessageCopy]) -> list[str | None]:
    """In a worker process: the callback on each copy in turn; for each, None (acked), ``""``
    (nacked by ``nack()``) or the repr of what it raised (nacked)."""
    outcomes: list[str | None] = []
    for message in messages:
        try:
            callback(message)
        except Exception as exc:  # noqa: BLE001 - user code; its failure is a nack
            outcomes.append(repr(exc))
            continue
        outcomes.append("" if message.nacked else None)
    return outcomes


def _replacement(broken: ProcessPoolExecutor) -> ProcessPoolExecutor:
    """A new pool with the broken one's settings."""
    return ProcessPoolExecutor(max_workers=getattr(broken, "_max_workers", None),
                               mp_context=getattr(broken, "_mp_context", None),
                               initializer=getattr(broken, "_initializer", None),
                               initargs=getattr(broken, "_initargs", ()))


_STOP = object()


Entry = tuple[list[Message], int, float | None]  # a run, the index of its next message, when it began


class ProcessCallbacks:
    """Messages run by worker processes, started and settled by one driver thread (module doc)."""

    def __init__(self, name: str, executor: ProcessPoolExecutor, callback: Callable[[Any], Any],
                 hooks: Hooks) -> None:
        try:
            pickle.dumps(callback)
        except Exception as exc:
            raise ConfigError(f"a callback for worker processes must be picklable (a top-level function): {exc!r}") \
                from exc
        self._executor = executor
        self._made: list[ProcessPoolExecutor] = []  # the replacements made here (shut down at the end)
        self._callback = callback
        self._hooks = hooks
        self._limit = 2 * (getattr(executor, "_max_workers", None) or os.cpu_count() or 1)  # tasks at a time
        self._events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._waiting: deque[Entry] = deque()  # not started yet
        # A task's future -> its entries (their run, index, when the run began) and its pool.
        self._running: dict[Future[list[str | None]], tuple[list[tuple[list[Message], int, float]],
                                                             ProcessPoolExecutor]] = {}
        self._casualties: set[tuple[int, int]] = set()  # (partition, offset) of messages nacked by a break
        self._alone = False  # a casualty is running: nothing else starts
        self._thread = threading.Thread(target=self._drive, name=name, daemon=True)
        self._thread.start()

    def submit(self, messages: list[Message]) -> None:
        self._events.put(items_of(messages))

    def watch(self, now: float) -> float | None:
        return None

    def shutdown(self) -> None:
        """Let the running messages finish, give back those not started, end the driver thread."""
        self._events.put(_STOP)
        self._thread.join()
        for pool in self._made:
            pool.shutdown(wait=True, cancel_futures=True)

    # -- the driver thread ---------------------------------------------------------------------------
    def _drive(self) -> None:
        stopping = False
        while not stopping or self._running:
            event = self._events.get()
            try:
                if event is _STOP:
                    stopping = True
                    for run, index, _ in self._waiting:
                        self._hooks.give_back(run[index:])
                    self._waiting.clear()
                elif isinstance(event, Future):
                    self._completed(event, stopping)
                else:
                    self._waiting.extend((item if isinstance(item, list) else [item], 0, None) for item in event)
                if not stopping:
                    self._fill()
            except Exception:
                _LOGGER.exception("the worker processes' driver failed on %r", event)

    def _fill(self) -> None:
        """Start tasks while there is room: a casualty alone, else up to ``BATCH_MAX`` messages (of
        different keys) when many wait."""
        waiting = self._waiting
        while waiting and not self._alone and len(self._running) < self._limit:
            if self._casualty(waiting[0]):
                if self._running:
                    return  # a casualty runs alone: it waits for the running ones
                self._alone = True
                self._start([waiting.popleft()])
                continue
            size = max(1, min(BATCH_MAX, len(waiting) // self._limit))
            batch = [waiting.popleft()]
            while waiting and len(batch) < size and not self._casualty(waiting[0]):
                batch.append(waiting.popleft())
            self._start(batch)

    def _casualty(self, entry: Entry) -> bool:
        record = entry[0][entry[1]].record
        return (record.partition, record.offset) in self._casualties

    def _start(self, batch: list[Entry]) -> None:
        """Start a task of the batch's messages (each start counted first, ``Engine.begin``); a
        message that may not run is left out, and the rest of its run goes back."""
        now = time.monotonic()
        entries: list[tuple[list[Message], int, float]] = []
        for run, index, began in batch:
            if self._hooks.begin(run[index]):
                entries.append((run, index, now if began is None else began))
            elif index + 1 < len(run):
                self._hooks.give_back(run[index + 1:])
        if not entries:
            self._alone = False
            return
        copies = [MessageCopy(run[index]) for run, index, _ in entries]
        for _ in range(2):
            pool = self._executor
            try:
                future = pool.submit(invoke, self._callback, copies)
            except BrokenProcessPool:
                self._replace(pool)
                continue
            except RuntimeError as exc:  # the pool was shut down: the messages go back unstarted
                _LOGGER.error("the process pool refused a callback (%r); giving its messages back", exc)
                self._alone = False
                for run, index, _ in entries:
                    self._hooks.give_back(run[index:])
                return
            self._running[future] = (entries, pool)
            future.add_done_callback(self._events.put)
            return
        raise RuntimeError("a new process pool refused a task")

    def _completed(self, future: Future[list[str | None]], stopping: bool) -> None:
        entries, pool = self._running.pop(future)
        self._alone = False  # a casualty ran alone: it is done
        exc = future.exception()
        if isinstance(exc, BrokenProcessPool):
            for run, index, _ in entries:
                _LOGGER.warning("a worker process died holding %r; nacking it", run[index])
                run[index].nack(error=f"worker process died: {exc!r}")
                if len(self._casualties) >= _CASUALTIES_MAX:
                    self._casualties.clear()
                record = run[index].record
                self._casualties.add((record.partition, record.offset))
            self._replace(pool)
        else:
            outcomes = [repr(exc)] * len(entries) if exc is not None else future.result()
            for (run, index, _), outcome in zip(entries, outcomes, strict=True):
                message = run[index]
                record = message.record
                self._casualties.discard((record.partition, record.offset))
                if outcome is None:
                    message.ack()
                elif outcome:
                    _LOGGER.warning("callback failed on %r: %s; nacking", message, outcome)
                    message.nack(error=outcome)
                else:
                    message.nack()
        for run, index, began in entries:
            following = index + 1
            if following < len(run):
                if not stopping and goes_on(run[index], began, run[following], self._hooks):
                    self._waiting.appendleft((run, following, began))
                else:
                    self._hooks.give_back(run[following:])

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        """Replace the pool once per break (the other futures it broke come after the first)."""
        if self._executor is not broken:
            return
        _LOGGER.warning("the process pool broke; replacing it")
        self._executor = _replacement(broken)
        self._made.append(self._executor)
        broken.shutdown(wait=False)
