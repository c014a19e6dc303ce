"""Executors alone (SUB-9): the event loop, a user's executor and worker processes run every message
once, keep a key's run one at a time (each once the one before it is acked), give back the rest,
and turn a raise, a nack of the copy or a dead worker process into a nack."""

from __future__ import annotations

import asyncio
import os
import pickle
import threading
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

import pytest

from ordering_layer._core import redeliveries
from ordering_layer.errors import ConfigError
from ordering_layer.record import RecordMetadata
from ordering_layer.subscriber.executors import AsyncWorkers, ExecutorCallbacks, LoopCallbacks, LoopWorkers, handoff_for
from ordering_layer.subscriber.handoff import CallbackPool
from ordering_layer.subscriber.message import Message
from ordering_layer.subscriber.processes import MessageCopy, ProcessCallbacks
from ordering_layer.subscriber.records import Record
from ordering_layer.subscriber.requests import Settle, SettleKind
from ordering_layer.subscriber.runs import Hooks, items_of
from tests.checker import wait_until


class Recorder:
    """Where the test messages' acks and nacks go, and the hooks' calls."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acked: list[int] = []
        self.nacked: list[int] = []
        self.begun: list[int] = []
        self.given_back: list[list[int]] = []

    def submit(self, request: Settle | Message | list[Message]) -> None:
        with self.lock:
            if isinstance(request, Message):
                self.acked.append(request.record.offset)
            elif isinstance(request, Settle):
                nacked = request.kind == SettleKind.NACK
                (self.nacked if nacked else self.acked).append(request.delivery.record.offset)

    def hooks(self) -> Hooks:
        def begin(message: Message) -> bool:
            with self.lock:
                self.begun.append(message.record.offset)
            return True

        def give_back(messages: list[Message]) -> None:
            with self.lock:
                self.given_back.append([m.record.offset for m in messages])

        return Hooks(begin, give_back, lambda message: True)

    def settled(self) -> int:
        with self.lock:
            return len(self.acked) + len(self.nacked)


def message(recorder: Recorder, offset: int, key: bytes, suspect: bool = False) -> Message:
    record = Record(0, offset, key, f"{key.decode()}:{offset}".encode(), [("a", b"1")],
                    RecordMetadata(None, None, None), 10, 1_700_000_000_000, suspect=suspect)
    return Message(record, key, token=offset, attempt=1, topic="t", epoch=1, submit=recorder.submit)


def test_items_of_groups_a_keys_consecutive_messages_as_one_run() -> None:
    recorder = Recorder()
    a0, a1, b2, a3 = (message(recorder, n, k) for n, k in ((0, b"a"), (1, b"a"), (2, b"b"), (3, b"a")))
    assert items_of([a0, a1, b2, a3]) == [[a0, a1], b2, a3]


def test_items_of_compares_keys_by_value_and_copies_a_batch_without_runs() -> None:
    """Equal keys that are different objects make a run (records of one key fetched apart); an
    unordered batch's offsets too; a batch of distinct keys comes back as a new list."""
    recorder = Recorder()
    first, second = message(recorder, 0, b"key"), message(recorder, 1, bytes(bytearray(b"key")))
    assert first.queue_key is not second.queue_key
    assert items_of([first, second]) == [[first, second]]
    unordered = [Message(m.record, 7, token=1, attempt=1) for m in (first, second)]
    assert items_of(unordered) == [unordered]
    distinct = [message(recorder, n, k) for n, k in ((0, b"a"), (1, b"b"), (2, b"a"))]
    items = items_of(distinct)
    assert items == distinct and items is not distinct
    assert items_of([]) == []


def test_redeliveries_counts_the_messages_past_their_first_attempt() -> None:
    recorder = Recorder()
    messages = [message(recorder, n, b"k") for n in range(4)]
    attempts = (1, 2, 1, 5)
    again = [Message(m.record, b"k", token=m.token, attempt=a) for m, a in zip(messages, attempts, strict=True)]
    assert redeliveries(again) == 2
    assert redeliveries([]) == 0


def test_loop_runs_many_keys_at_once_on_one_thread_and_a_raise_nacks() -> None:
    """SUB-9: coroutines of different keys are in flight together on the loop's one thread; one
    that raises nacks its message; a suspect's start is made off the loop."""
    recorder = Recorder()
    threads: set[str] = set()
    inside, most = [0], [0]
    begin_threads: list[str] = []
    hooks = recorder.hooks()

    def begin(message: Message) -> bool:
        begin_threads.append(threading.current_thread().name)
        return hooks.begin(message)

    async def callback(message: Message) -> None:
        threads.add(threading.current_thread().name)
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        await asyncio.sleep(0.05)
        inside[0] -= 1
        if message.record.offset == 7:
            raise ValueError("boom")
        message.ack()

    pool = LoopCallbacks("test-loop", callback, Hooks(begin, hooks.give_back, hooks.current))
    pool.submit([message(recorder, n, f"k{n}".encode(), suspect=n == 3) for n in range(20)])
    wait_until(lambda: recorder.settled() == 20, 10, "all settled")
    pool.shutdown()
    assert len(threads) == 1 and most[0] >= 19, "all in flight together (the suspect's after its start write)"
    assert recorder.nacked == [7] and sorted(recorder.acked) == [n for n in range(20) if n != 7]
    assert sum("begin" in name for name in begin_threads) == 1, "only the suspect's start off the loop"


@pytest.mark.parametrize("kind", ["loop", "workers", "threads", "pool"])
def test_a_keys_run_is_one_at_a_time_and_the_rest_goes_back_after_a_nack(
        kind: str, own_loop: asyncio.AbstractEventLoop) -> None:
    """SUB-1 (SUB-9, every executor): a key's run starts each message once the one before it is
    acked, never two at once; after a nack the rest goes back unstarted."""
    recorder = Recorder()
    inside = [0]
    overlaps: list[int] = []
    started: list[int] = []

    def body(msg: Message) -> None:
        started.append(msg.record.offset)
        if inside[0] > 1:
            overlaps.append(msg.record.offset)
        if msg.record.offset == 2:
            msg.nack()
        else:
            msg.ack()

    async def coroutine(msg: Message) -> None:
        inside[0] += 1
        await asyncio.sleep(0.01)
        body(msg)
        inside[0] -= 1

    def plain(msg: Message) -> None:
        inside[0] += 1
        body(msg)
        inside[0] -= 1

    hooks = recorder.hooks()
    executor = ThreadPoolExecutor(4)
    pool: Any
    if kind == "loop":
        pool = LoopCallbacks("test-loop", coroutine, hooks)
    elif kind == "workers":
        pool = LoopWorkers("test-workers", coroutine, hooks, AsyncWorkers(own_loop, 2))
    elif kind == "threads":
        pool = ExecutorCallbacks(executor, plain, hooks)
    else:
        pool = handoff_for("test-pool", plain, executor=None, max_workers=4, run=plain, hooks=hooks, tracing=None)
        assert isinstance(pool, CallbackPool)
    pool.submit([message(recorder, n, b"k") for n in range(5)])
    wait_until(lambda: recorder.settled() == 3 and recorder.given_back, 10, "the run settled")
    pool.shutdown()
    executor.shutdown()
    assert started == [0, 1, 2] and overlaps == []
    assert recorder.given_back == [[3, 4]]


def copy_callback(copy: MessageCopy) -> str:
    """Top-level (picklable): nacks odd offsets by nack(), raises on 4, dies on 6 (first attempt)."""
    if copy.offset() == 4:
        raise ValueError("four")
    if copy.offset() == 6 and copy.delivery_attempt == 1:
        os._exit(3)
    if copy.offset() % 2:
        copy.nack()
    return copy.ordering_key


def test_message_copy_is_picklable_and_has_the_fields() -> None:
    recorder = Recorder()
    copy = pickle.loads(pickle.dumps(MessageCopy(message(recorder, 5, b"key"))))
    assert (copy.data, copy.ordering_key, copy.attributes, copy.delivery_attempt) == (b"key:5", "key", {"a": "1"}, 1)
    assert (copy.partition(), copy.offset(), copy.key(), copy.topic()) == (0, 5, b"key", "t")
    assert copy.message_id == str(5) and copy.publish_time.year == 2023 and copy.headers() == [("a", b"1")]


def test_worker_processes_ack_on_return_nack_on_raise_and_nack_what_a_dead_process_held() -> None:
    """SUB-9: returning acks, raising or nack() on the copy nacks; a process that dies nacks its
    message and the pool is replaced; the rest go on in the new pool."""
    recorder = Recorder()
    executor = ProcessPoolExecutor(2)
    pool = ProcessCallbacks("test-procs", executor, copy_callback, recorder.hooks())
    pool.submit([message(recorder, n, f"k{n}".encode()) for n in (0, 1, 2, 4, 6, 8, 10, 12)])
    wait_until(lambda: recorder.settled() >= 8, 60, "all settled")
    pool.shutdown()
    executor.shutdown()
    assert 6 in recorder.nacked and 4 in recorder.nacked and 1 in recorder.nacked
    assert {0, 2, 8, 10, 12} - set(recorder.acked) <= set(recorder.nacked), "innocents nacked only beside a death"
    assert sorted(recorder.begun) == [0, 1, 2, 4, 6, 8, 10, 12]


def test_worker_processes_refuse_a_callback_that_cannot_be_pickled() -> None:
    recorder = Recorder()
    with ProcessPoolExecutor(1) as executor, pytest.raises(ConfigError):
        handoff_for("test", lambda m: None, executor=executor, max_workers=1, run=lambda m: None,
                    hooks=recorder.hooks(), tracing=None)


def test_executor_refused_with_a_coroutine_function() -> None:
    async def callback(message: Message) -> None:
        message.ack()

    with ThreadPoolExecutor(1) as executor, pytest.raises(ConfigError):
        handoff_for("test", callback, executor=executor, max_workers=1, run=lambda m: None,
                    hooks=Recorder().hooks(), tracing=None)


def test_a_shut_down_executor_gives_the_messages_back() -> None:
    """An executor shut down under a running subscription refuses the callbacks: their messages go
    back unstarted (redelivered later), the coordinator is not stopped by it."""
    recorder = Recorder()
    executor = ThreadPoolExecutor(1)
    executor.shutdown()
    pool = ExecutorCallbacks(executor, lambda m: m.ack(), recorder.hooks())
    pool.submit([message(recorder, 0, b"a"), message(recorder, 1, b"a"), message(recorder, 2, b"b")])
    pool.shutdown()
    assert recorder.given_back == [[0, 1], [2]] and recorder.settled() == 0


def killer_callback(copy: MessageCopy) -> None:
    """Top-level (picklable): offset 6 exits its process on every delivery."""
    if copy.offset() == 6:
        os._exit(3)


def test_a_message_nacked_by_a_break_runs_alone_when_it_comes_again() -> None:
    """SUB-9, DLQ-3: a break nacks what the pool held (attempts counted); when those messages come
    again each runs alone, so the poison's next death takes down no other message."""
    first = Recorder()
    executor = ProcessPoolExecutor(2)
    pool = ProcessCallbacks("test-procs", executor, killer_callback, first.hooks())
    pool.submit([message(first, n, f"k{n}".encode()) for n in range(12)])
    wait_until(lambda: first.settled() == 12, 60, "the first round settled")
    assert 6 in first.nacked
    again = Recorder()
    pool._hooks = again.hooks()
    pool.submit([message(again, n, f"k{n}".encode()) for n in sorted(first.nacked)]
                + [message(again, n, f"k{n}".encode()) for n in range(20, 40)])
    wait_until(lambda: again.settled() == len(first.nacked) + 20, 60, "the second round settled")
    pool.shutdown()
    executor.shutdown()
    assert again.nacked == [6], "only the poison died, alone"


@pytest.fixture
def own_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running in a thread of the test's (as a caller's own loop would)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def test_coroutines_run_on_a_loop_given_as_executor_which_stays_running(
        own_loop: asyncio.AbstractEventLoop) -> None:
    """SUB-9, ``subscribe(executor=loop)``: the callbacks are awaited on the caller's loop; shutdown
    waits for them and leaves that loop running."""
    recorder = Recorder()
    ran_on: list[asyncio.AbstractEventLoop] = []

    async def callback(msg: Message) -> None:
        await asyncio.sleep(0.01)
        ran_on.append(asyncio.get_running_loop())
        msg.ack()

    pool = handoff_for("test", callback, executor=own_loop, max_workers=1, run=lambda m: None,
                       hooks=recorder.hooks(), tracing=None)
    assert isinstance(pool, LoopCallbacks) and pool.loop is own_loop
    pool.submit([message(recorder, n, f"k{n}".encode()) for n in range(5)])
    pool.shutdown()  # waits for the five
    assert sorted(recorder.acked) == [0, 1, 2, 3, 4] and ran_on == [own_loop] * 5
    assert own_loop.is_running()
    assert asyncio.run_coroutine_threadsafe(asyncio.sleep(0, "serving"), own_loop).result(5) == "serving"


def test_a_loop_as_executor_is_refused_for_a_plain_function_or_when_not_running(
        own_loop: asyncio.AbstractEventLoop) -> None:
    """A clear ``ConfigError`` for what cannot work: a plain function on a loop, a loop nobody runs,
    and a ``concurrent.futures`` executor for a coroutine function."""

    async def coroutine(msg: Message) -> None:
        return None

    def plain(msg: Message) -> None:
        return None

    common: dict[str, Any] = {"max_workers": 1, "run": plain, "hooks": Recorder().hooks(), "tracing": None}
    with pytest.raises(ConfigError, match="plain function"):
        handoff_for("test", plain, executor=own_loop, **common)
    idle = asyncio.new_event_loop()
    try:
        with pytest.raises(ConfigError, match="not running"):
            handoff_for("test", coroutine, executor=idle, **common)
    finally:
        idle.close()
    with ThreadPoolExecutor(1) as threads, pytest.raises(ConfigError, match="plain functions"):
        handoff_for("test", coroutine, executor=threads, **common)


def test_async_workers_run_at_most_their_number_at_once_in_release_order(
        own_loop: asyncio.AbstractEventLoop) -> None:
    """SUB-9, ``subscribe(executor=AsyncWorkers(loop, n))``: ``n`` coroutines on the caller's loop
    take the released messages in order, at most ``n`` callbacks at once; the rest wait, counted by
    ``waiting``; shutdown runs what is queued and leaves the loop running."""
    recorder = Recorder()
    workers = AsyncWorkers(own_loop, 3)
    inside, most, order, waiting = [0], [0], [], []
    release = asyncio.Event()

    async def callback(msg: Message) -> None:
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        order.append(msg.record.offset)
        waiting.append(workers.waiting)
        await release.wait()
        inside[0] -= 1
        msg.ack()

    pool = handoff_for("test", callback, executor=workers, max_workers=1, run=lambda m: None,
                       hooks=recorder.hooks(), tracing=None)
    assert isinstance(pool, LoopWorkers) and pool.loop is own_loop
    pool.submit([message(recorder, n, f"k{n}".encode()) for n in range(12)])
    wait_until(lambda: len(order) == 3, 5, "three workers busy")
    assert workers.waiting == 9, "the other nine wait in the queue"
    own_loop.call_soon_threadsafe(release.set)
    pool.shutdown()
    assert order == list(range(12)) and most[0] == 3
    assert sorted(recorder.acked) == list(range(12)) and waiting[:3] == [11, 10, 9] and workers.waiting == 0
    assert own_loop.is_running()


def test_async_workers_are_refused_when_they_cannot_work(own_loop: asyncio.AbstractEventLoop) -> None:
    """A clear ``ConfigError``: no workers, a plain function, one ``AsyncWorkers`` for two
    subscriptions."""

    async def coroutine(msg: Message) -> None:
        return None

    common: dict[str, Any] = {"max_workers": 1, "run": lambda m: None, "hooks": Recorder().hooks(), "tracing": None}
    with pytest.raises(ConfigError, match="at least 1"):
        AsyncWorkers(own_loop, 0)
    workers = AsyncWorkers(own_loop, 2)
    with pytest.raises(ConfigError, match="plain function"):
        handoff_for("test", lambda m: None, executor=workers, **common)
    pool = handoff_for("test", coroutine, executor=workers, **common)
    with pytest.raises(ConfigError, match="one subscription"):
        handoff_for("test", coroutine, executor=workers, **common)
    pool.shutdown()
