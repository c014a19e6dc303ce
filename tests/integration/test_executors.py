"""Where callbacks run (SUB-9) against the real broker and Redis: a coroutine function on the
subscriber's event loop or run by ``AsyncWorkers`` on a loop of the caller's, a ThreadPoolExecutor,
a ProcessPoolExecutor. Each keeps per-key order
(SUB-1), the nack cascade (SUB-4), lease extension (ACK-2) and exact dead-lettering (DLQ-3).

Callbacks in worker processes append their events to a file named by ``$OL_TEST_EVENTS`` (lines of
JSON with a wall-clock time); the test reads it and feeds the delivery checker."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import pytest

from ordering_layer import DeadLetterPolicy, FlowControl, Message, Subscriber
from ordering_layer.subscriber import AsyncWorkers
from ordering_layer.subscriber.processes import MessageCopy
from tests.checker import DeliveryChecker, wait_until
from tests.integration.conftest import publish_keys
from tests.kafka_helpers import read_topic

pytestmark = pytest.mark.integration

EXECUTORS = ["coroutine", "workers", "threads", "processes"]
WORKERS = 4  # the "workers" kind: a coroutine run by this many AsyncWorkers on a loop of the test's
NACK_FIRST = 7  # a key's message at this index is nacked on its first delivery (cascade tests)


# -- the callback run in worker processes (top-level: picklable) -------------------------------------
def _log(copy: MessageCopy | Message, action: str) -> None:
    line = json.dumps({"id": copy.message_id, "attempt": copy.delivery_attempt, "action": action,
                       "at": time.time(), "pid": os.getpid(), "sub": os.environ.get("OL_TEST_SUB", "s1")}) + "\n"
    with open(os.environ["OL_TEST_EVENTS"], "a") as events:
        events.write(line)


def process_callback(copy: MessageCopy) -> None:
    """Records the delivery; ``data`` ``key-k:n`` tells what to do (env ``OL_TEST_MODE``): ``nack``
    raises on the first delivery of index NACK_FIRST; ``poison`` exits the process on ``key-0:1``;
    ``hold`` writes its pid to ``$OL_TEST_EVENTS.pid`` on the first delivery of ``key-0:1`` and
    waits to be killed."""
    _log(copy, "deliver")
    mode = os.environ.get("OL_TEST_MODE", "")
    index = int(copy.data.split(b":")[1])
    if mode == "nack" and index == NACK_FIRST and copy.delivery_attempt == 1:
        _log(copy, "nack")
        raise RuntimeError("nacked on purpose")
    if mode == "poison" and copy.data == b"key-0:1":
        _log(copy, "nack")  # what the subscriber makes of the death
        os._exit(3)
    if mode == "hold" and copy.data == b"key-0:1" and copy.delivery_attempt == 1:
        Path(os.environ["OL_TEST_EVENTS"] + ".pid").write_text(str(os.getpid()))
        time.sleep(120)
    _log(copy, "ack")


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


# -- a subscription run through one executor, recorded by the checker ----------------------------------
class Run:
    """Subscribes with ``executor`` ("coroutine", "workers", "threads", "processes"); in-process
    callbacks record to the checker at once, worker processes through the events file (``load``).
    ``most``: the most coroutines in a callback at once."""

    def __init__(self, kind: str, checker: DeliveryChecker, events: Path, mode: str = "",
                 hold: Callable[[Message], float] | None = None) -> None:
        self.kind, self.checker, self.events, self.mode = kind, checker, events, mode
        self.hold = hold  # seconds an in-process callback holds a message (coroutines: awaited)
        self.loaded = False
        self.inside = self.most = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.killed_in: str | None = None  # the message a killed process held (its nack recorded by the test)

    def _decide(self, message: Message) -> str:
        index = int(message.data.split(b":")[1])
        if self.mode == "nack" and index == NACK_FIRST and message.delivery_attempt == 1:
            return "nack"
        return "ack"

    def subscribe(self, subscriber: Subscriber, name: str, **options: Any) -> Any:
        checker = self.checker
        if self.kind == "processes":
            os.environ["OL_TEST_EVENTS"], os.environ["OL_TEST_MODE"] = str(self.events), self.mode
            self.pool = ProcessPoolExecutor(2)
            return subscriber.subscribe(name, cast(Any, process_callback), executor=self.pool, **options)

        def settle(message: Message) -> None:
            action = self._decide(message)
            checker.record(message.message_id, "s1", message.delivery_attempt, action)
            if action == "ack":
                message.ack()
            else:
                message.nack()

        if self.kind in ("coroutine", "workers"):
            async def coroutine(message: Message) -> None:
                self.inside += 1
                self.most = max(self.most, self.inside)
                checker.record(message.message_id, "s1", message.delivery_attempt, "deliver")
                await asyncio.sleep(self.hold(message) if self.hold else 0.001)
                self.inside -= 1
                settle(message)

            if self.kind == "coroutine":
                return subscriber.subscribe(name, coroutine, **options)
            self.loop = asyncio.new_event_loop()
            threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True).start()
            wait_until(self.loop.is_running, 5, "the test's loop running")
            return subscriber.subscribe(name, coroutine, executor=AsyncWorkers(self.loop, WORKERS), **options)

        def plain(message: Message) -> None:
            checker.record(message.message_id, "s1", message.delivery_attempt, "deliver")
            if self.hold:
                time.sleep(self.hold(message))
            settle(message)

        self.pool = ThreadPoolExecutor(8)  # type: ignore[assignment]
        return subscriber.subscribe(name, plain, executor=self.pool, **options)

    def acked(self) -> int:
        if self.kind != "processes":
            return self.checker.acked_count()
        return len({e["id"] for e in _events(self.events) if e["action"] == "ack"})

    def finish(self) -> None:
        """After cancel: the worker processes' events into the checker; the pool shut down.

        A worker process that dies (killed by the test, or exiting in a poison's callback) breaks
        the pool, whose other process is ended with it, and the subscriber nacks everything the
        pool held (ACK-6), which the processes' logs do not say. A process is known dead at a
        redelivery when it logged nothing from then on:
        - a task of several messages is settled when it returns, so the messages a dead process
          ran before the one it died in were logged as acked there: such an ack followed by a
          later attempt of its message is recorded as that nack;
        - a delivery logged with no outcome, by a process dead at its message's next attempt, is
          recorded as nacked just before that attempt (but the one the test killed a process in,
          whose nack the test records)."""
        if self.kind == "processes":
            events = _events(self.events)
            redelivered = {(e["id"], e["attempt"] - 1): e["at"] for e in events if e["action"] == "deliver"}
            settled = {(e["id"], e["attempt"]) for e in events if e["action"] != "deliver"}
            last_seen: dict[int, float] = {}
            for event in events:
                last_seen[event["pid"]] = max(last_seen.get(event["pid"], event["at"]), event["at"])
            for event in events:
                action, attempt = event["action"], (event["id"], event["attempt"])
                dead = attempt in redelivered and last_seen[event["pid"]] < redelivered[attempt]
                if action == "ack" and dead:
                    action = "nack"
                self.checker.record(event["id"], "s1", event["attempt"], action, at=event["at"])
                if action == "deliver" and dead and attempt not in settled and event["id"] != self.killed_in:
                    self.checker.record(event["id"], "s1", event["attempt"], "nack", at=redelivered[attempt] - 1e-6)
        self.pool_shutdown()

    def pool_shutdown(self) -> None:
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown()
        if self.loop is not None:
            assert self.loop.is_running(), "cancelling leaves the caller's loop running"
            self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def events(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "events.jsonl"
    for name in ("OL_TEST_EVENTS", "OL_TEST_MODE"):
        os.environ.pop(name, None)


@pytest.mark.parametrize("kind", EXECUTORS)
def test_sub9_per_key_order_over_thousands_of_messages(
        kind: str, kafka_config: dict[str, Any], endpoints: Any, events: Path,
        subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-9, SUB-1, SUB-3: 3,000 messages over 60 keys in 3 partitions, every executor: every
    message acked, a key's messages one at a time in publish order (the delivery checker)."""
    topic, name = subscription(partitions=3)
    checker = publish_keys(kafka_config, topic, keys=60, per_key=50)
    run = Run(kind, checker, events)
    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with run.subscribe(subscriber, name):
        wait_until(lambda: run.acked() == checker.total(), 120, "every message acked")
    run.finish()
    assert checker.verify() == []
    if kind == "workers":
        assert run.most == WORKERS, "at most (and, with 60 keys ready, exactly) the workers at once"


@pytest.mark.parametrize("kind", EXECUTORS)
def test_sub9_nack_cascades_in_order(kind: str, kafka_config: dict[str, Any], endpoints: Any, events: Path,
                                     subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-9, SUB-4: the first delivery of each key's message #7 is nacked (a raise in the worker
    process); it and the key's later messages come again in order, and every message is acked."""
    topic, name = subscription(partitions=2)
    checker = publish_keys(kafka_config, topic, keys=20, per_key=20)
    run = Run(kind, checker, events, mode="nack")
    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with run.subscribe(subscriber, name):
        wait_until(lambda: run.acked() == checker.total(), 120, "every message acked")
    run.finish()
    assert checker.verify() == []
    for key, ids in checker.published.items():
        attempts = [e.attempt for e in checker.deliveries(key) if e.message_id == ids[NACK_FIRST]]
        assert attempts == [1, 2], (key, attempts)


@pytest.mark.parametrize("kind", ["coroutine", "workers", "threads"])
def test_sub9_lease_extended_for_a_15_s_callback_under_a_10_s_deadline(
        kind: str, kafka_config: dict[str, Any], endpoints: Any, events: Path,
        subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-9, ACK-2: a callback (an awaited coroutine, or a thread of the executor) holding a message
    15 s under a 10 s ack deadline is not redelivered: its lease is extended; other keys go on."""
    topic, name = subscription(partitions=1, ack_deadline=10)
    checker = publish_keys(kafka_config, topic, keys=3, per_key=2)
    slow = checker.published["key-0"][0]
    run = Run(kind, checker, events, hold=lambda m: 15.0 if m.message_id == slow else 0.001)
    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with run.subscribe(subscriber, name):
        wait_until(lambda: run.acked() == 4, 30, "the other keys acked while key-0's first is held")
        wait_until(lambda: run.acked() == checker.total(), 60, "the slow message and its key acked")
    run.finish()
    assert [e.attempt for e in checker.deliveries("key-0")] == [1, 1]
    assert checker.verify() == []


def test_sub9_lease_extended_for_a_15_s_worker_process(
        kafka_config: dict[str, Any], endpoints: Any, events: Path,
        subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-9, ACK-2: a message held 15 s by a worker process (``slow_callback``) under a 10 s ack
    deadline is delivered once."""
    topic, name = subscription(partitions=1, ack_deadline=10)
    checker = publish_keys(kafka_config, topic, keys=2, per_key=2)
    os.environ["OL_TEST_EVENTS"] = str(events)
    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with ProcessPoolExecutor(2) as pool, subscriber.subscribe(name, cast(Any, slow_callback), executor=pool):
        wait_until(lambda: len({e["id"] for e in _events(events) if e["action"] == "ack"}) == 4, 60, "all acked")
    for event in _events(events):
        checker.record(event["id"], "s1", event["attempt"], event["action"], at=event["at"])
    assert [e.attempt for e in checker.deliveries()] == [1, 1, 1, 1]
    assert checker.verify() == []


def slow_callback(copy: MessageCopy) -> None:
    """Holds ``key-0:0`` 15 s (picklable, for ``test_sub9_lease_extended_for_a_15_s_worker_process``)."""
    _log(copy, "deliver")
    if copy.data == b"key-0:0":
        time.sleep(15)
    _log(copy, "ack")


def test_sub9_worker_process_killed_mid_message_nacks_it_and_the_pool_is_replaced(
        kafka_config: dict[str, Any], endpoints: Any, events: Path,
        subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-9, ACK-6: kill -9 of the worker process holding a message: it is nacked (its attempt
    counted: redelivered as attempt 2), the pool is replaced, and every message is acked in order."""
    topic, name = subscription(partitions=2)
    checker = publish_keys(kafka_config, topic, keys=10, per_key=20)
    run = Run("processes", checker, events, mode="hold")
    held = run.killed_in = checker.published["key-0"][1]
    pid_file = Path(str(events) + ".pid")
    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with run.subscribe(subscriber, name):
        wait_until(pid_file.exists, 60, "key-0:1 held by a worker process")
        wait_until(lambda: pid_file.read_text() != "", 10, "its pid written")
        killed = int(pid_file.read_text())
        os.kill(killed, signal.SIGKILL)
        checker.record(held, "s1", 1, "nack")  # what the subscriber makes of the death
        wait_until(lambda: run.acked() == checker.total(), 120, "every message acked")
    run.finish()
    assert [e.attempt for e in checker.deliveries() if e.message_id == held] == [1, 2]
    assert checker.verify() == []


def test_sub9_poison_killing_its_worker_process_is_dead_lettered_after_exactly_max_attempts(
        kafka_config: dict[str, Any], endpoints: Any, events: Path, unique_name: Callable[[str], str],
        subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-9, DLQ-3: a message whose callback exits its worker process on every delivery is
    dead-lettered after exactly max_delivery_attempts (5) deliveries; the other messages are all
    acked, none dead-lettered (a message nacked beside a death runs alone when it comes again)."""
    dlq = unique_name("dlq")
    topic, name = subscription(partitions=2, dead_letter_policy=DeadLetterPolicy(dlq, max_delivery_attempts=5))
    checker = publish_keys(kafka_config, topic, keys=10, per_key=10)
    poison = checker.published["key-0"][1]
    run = Run("processes", checker, events, mode="poison")
    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with run.subscribe(subscriber, name):
        wait_until(lambda: run.acked() == checker.total() - 1, 120, "all but the poison acked")
        records = read_topic(kafka_config, dlq, 1)
    run.finish()
    assert len(records) == 1
    assert [e.attempt for e in checker.deliveries() if e.message_id == poison] == [1, 2, 3, 4, 5]
    checker.record(poison, "s1", 5, "dead")
    assert checker.verify(max_delivery_attempts=5) == []


def test_sub9_coroutines_many_keys_in_flight_on_one_thread(
        kafka_config: dict[str, Any], endpoints: Any, subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-9: 200 keys, each coroutine awaiting 0.2 s: they are in user code together on one thread
    (up to flow control's max_messages), so 200 messages take far less than 200 x 0.2 s."""
    topic, name = subscription(partitions=2)
    checker = publish_keys(kafka_config, topic, keys=200, per_key=1)
    inside, most, threads = [0], [0], set()
    lock = threading.Lock()

    async def callback(message: Message) -> None:
        threads.add(threading.current_thread().name)
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        await asyncio.sleep(0.2)
        with lock:
            inside[0] -= 1
        checker.record(message.message_id, "s1", message.delivery_attempt, "deliver")
        checker.record(message.message_id, "s1", message.delivery_attempt, "ack")
        message.ack()

    subscriber = Subscriber(kafka_config, redis_url=endpoints.redis_url)
    with subscriber.subscribe(name, callback, flow_control=FlowControl(max_messages=100)):
        wait_until(lambda: checker.acked_count() == 200, 30, "all acked")
    assert len(threads) == 1 and 50 <= most[0] <= 100
    assert checker.verify() == []


# -- kill -9 of the subscriber process ------------------------------------------------------------------
async def coroutine_callback(message: Message) -> None:
    """``process_callback``'s ``hold`` mode as a coroutine (for the subscriber process below)."""
    _log(message, "deliver")
    if message.data == b"key-0:1" and message.delivery_attempt == 1:
        Path(os.environ["OL_TEST_EVENTS"] + ".pid").write_text(str(os.getpid()))
        await asyncio.sleep(120)
    await asyncio.sleep(0.001)
    _log(message, "ack")
    message.ack()


def subscriber_process() -> None:
    """``python -m tests.integration.test_executors KIND SUBSCRIPTION KAFKA_JSON REDIS_URL``: a
    subscriber with KIND's executor, the events in ``$OL_TEST_EVENTS``, until killed."""
    kind, name, kafka_json, redis_url = sys.argv[1:5]
    kafka = {**json.loads(kafka_json), "session.timeout.ms": 6000, "heartbeat.interval.ms": 1000}
    subscriber = Subscriber(kafka, redis_url=redis_url)
    if kind == "coroutine":
        subscriber.subscribe(name, coroutine_callback)
    else:
        subscriber.subscribe(name, cast(Any, process_callback), executor=ProcessPoolExecutor(2))
    time.sleep(600)


@pytest.mark.parametrize("kind", ["coroutine", "processes"])
def test_sub9_kill_9_of_the_subscriber_redelivers_in_order_with_the_attempt_counted(
        kind: str, kafka_config: dict[str, Any], endpoints: Any, events: Path,
        subscription: Callable[..., tuple[str, str]]) -> None:
    """SUB-9, SUB-3, SUB-4, ACK-6: kill -9 of a subscriber process (with its worker processes) while
    its callback holds ``key-0:1``; the next subscriber delivers it again as attempt 2, and every
    message is acked in per-key order (the subscribers' events checked together)."""
    topic, name = subscription(partitions=2)
    checker = publish_keys(kafka_config, topic, keys=10, per_key=20)
    held = checker.published["key-0"][1]
    pid_file = Path(str(events) + ".pid")
    root = Path(__file__).resolve().parents[2]

    def start(sub: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": str(root), "OL_TEST_EVENTS": str(events), "OL_TEST_MODE": "hold",
               "OL_TEST_SUB": sub}
        return subprocess.Popen([sys.executable, "-m", "tests.integration.test_executors", kind, name,
                                 json.dumps(kafka_config), endpoints.redis_url], cwd=root, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def acked() -> int:
        return len({e["id"] for e in _events(events) if e["action"] == "ack"})

    first = start("w1")
    second = None
    try:
        wait_until(lambda: pid_file.exists() and pid_file.read_text() != "", 60, "key-0:1 held by w1")
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
        checker.subscriber_died("w1")
        second = start("w2")
        wait_until(lambda: acked() == checker.total(), 120, "every message acked by w1 or w2")
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
    for event in _events(events):
        checker.record(event["id"], event["sub"], event["attempt"], event["action"], at=event["at"])
    assert [(e.subscriber, e.attempt) for e in checker.deliveries() if e.message_id == held] == [("w1", 1), ("w2", 2)]
    assert checker.verify() == []


if __name__ == "__main__":
    subscriber_process()
