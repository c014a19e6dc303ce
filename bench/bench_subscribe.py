"""Subscriber benchmarks against raw confluent-kafka, same data, same run (issues 3 and 4).

(a) no-op handler, 100-byte messages, 10,000 keys: layer msgs/s vs a raw consume loop with commits;
    the goal is about callback mode (``Subscriber.subscribe``); the same workload is also measured
    through pull mode (``Subscriber.pull`` + ``acknowledge``) and ``OrderedConsumer.consume`` + ack,
    and in callback mode with the subscriber fetching through ``consume()`` instead of natively
    (``ORDERING_LAYER_NATIVE_FETCH=0``);
(b) one partition, 5 ms I/O handler, K = 1, 20, 1000 keys: speedup vs a one-at-a-time consumer;
(c) one key with a 1 s handler among fast keys in one partition: fast keys' throughput vs without it;
(d) Redis round trips per message during (a), from INFO commandstats: the commands the layer
    sends itself (EVALSHA of the batched Lua script, GET, INCR, SMEMBERS, ...); the commands that
    the scripts run inside Redis (HSET, ZADD, HDEL, ...) are counted by Redis too but cost no round
    trip, and several EVALSHAs in one pipeline are still one round trip, so this is an upper bound;
(e) 10,000 keys, 1 ms handler, 16 workers: an ordered subscription vs an unordered one on the same
    topic (the cost of per-key ordering when keys are plentiful);
(f) a coroutine callback (``await asyncio.sleep(0.005)`` then ack) on the subscriber's event loop,
    100 keys and 1,000 keys (SUB-9; ceilings min(keys, outstanding) / 5 ms);
(g) a ~2 ms pure-Python CPU-bound callback over 200 keys: ``executor=ProcessPoolExecutor(2)`` vs
    the subscriber's thread pool (SUB-9);
(h) the ceiling of callback mode's thread shape: (a)'s workload through that shape with no
    bookkeeping at all (``bare_shape``: a fetch thread, a coordinator that wraps each record in a
    slots object under the same 1,000 outstanding, one callback thread whose no-op callback posts
    each ack back; no keys, leases, Redis or commits), against the raw loop and the layer's
    callback mode, rounds interleaved; then one more callback pass with the coordinator's thread CPU
    per step, fitted as a cost per step plus a cost per message.

Every consumer, raw or the layer's, fetches with ``fetch.queue.backoff.ms`` at the layer's default
(``FETCH_QUEUE_BACKOFF_MS``).

(a) and (e) run ``--rounds`` interleaved rounds on the same topic (each reader has its own group
from the earliest offset) and print every round and the median of the per-round ratios.

    .venv/bin/python bench/bench_subscribe.py [--messages 100000] [--workers 16] [--rounds 3]
        [--scenarios abcdefgh]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import itertools
import os
import resource
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, TopicPartition

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import bench_stack, ratio_line
from ordering_layer import Admin, FlowControl, Message, OrderedConsumer, OrderedProducer, RetryPolicy, Subscriber
from ordering_layer.stack import Endpoints
from ordering_layer.state.client import redis_client
from ordering_layer.subscriber.client_config import FETCH_QUEUE_BACKOFF_MS
from ordering_layer.subscriber.engine import Engine
from ordering_layer.subscriber.native_fetch import open_native_fetch
from ordering_layer.subscriber.partitions import Partitions


def publish(endpoints: Endpoints, topic: str, keys: list[str], count: int, payload: bytes = b"x" * 100) -> None:
    with OrderedProducer(endpoints.kafka_config()) as producer:
        for n in range(count):
            producer.produce(topic, payload, key=keys[n % len(keys)])


def workload_topic(endpoints: Endpoints, admin: Admin, prefix: str, count: int) -> str:
    """A new topic (``prefix``-<random>, 6 partitions) of bench (a)'s workload: ``count`` messages of
    100 B over 10,000 keys. Returns its name."""
    topic = f"{prefix}-{uuid.uuid4().hex[:8]}"
    admin.create_topic(topic, partitions=6)
    publish(endpoints, topic, [f"key-{i}" for i in range(10_000)], count)
    return topic


def raw_consume(endpoints: Endpoints, topic: str, count: int, handler_seconds: float = 0.0,
                one_at_a_time: bool = False) -> float:
    """A plain consumer: consume, handle, commit (per batch, or per message when one at a time). It
    gets the subscriber's ``fetch.queue.backoff.ms`` too, so that neither side meets librdkafka's
    one-second fetch stall that the other is spared."""
    consumer = Consumer({**endpoints.kafka_config(), "group.id": f"raw-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "auto.offset.reset": "earliest",
                         "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS})
    consumer.subscribe([topic])
    seen = 0
    start = 0.0
    while seen < count:
        batch = consumer.consume(1 if one_at_a_time else 500, 1.0)
        if batch and not start:
            start = time.perf_counter()
        for msg in batch:
            if msg.error() is None:
                if handler_seconds:
                    time.sleep(handler_seconds)
                seen += 1
        if batch and one_at_a_time:
            consumer.commit(asynchronous=False)
        elif batch:
            consumer.commit(asynchronous=True)
    elapsed = time.perf_counter() - start
    consumer.close()
    return count / elapsed


def layer_consume(endpoints: Endpoints, admin: Admin, topic: str, count: int, workers: int,
                  handler: Any = None, done_when: Any = None, track_leases: bool = True,
                  ordered: bool = True) -> float:
    """The layer: a subscription (ordered unless told), callback mode, acking after ``handler``."""
    name = f"bench-{uuid.uuid4().hex[:8]}"
    admin.create_subscription(name, topic=topic, retry_policy=RetryPolicy(0, 0), enable_message_ordering=ordered)
    acks = itertools.count(1)  # next() is atomic under the GIL: the callbacks count without a lock
    first = [0.0]
    finished = threading.Event()

    def callback(message: Message) -> None:
        if not first[0]:
            first[0] = time.perf_counter()
        if handler is not None:
            handler(message)
        message.ack()
        acked = next(acks)
        if (done_when(message) if done_when else acked >= count):
            finished.set()

    subscriber = Subscriber(endpoints.kafka_config(), redis_url=endpoints.redis_url)
    handle = subscriber.subscribe(name, callback, max_workers=workers,
                                  flow_control=FlowControl(max_messages=max(1000, workers * 4)),
                                  track_leases=track_leases)
    finished.wait(600)
    elapsed = time.perf_counter() - first[0]
    handle.cancel()
    return count / elapsed


def layer_pull(endpoints: Endpoints, admin: Admin, topic: str, count: int, batch: int = 500) -> float:
    """Pull mode on one thread: ``Subscriber.pull`` then ``acknowledge`` the whole batch."""
    name = f"bench-pull-{uuid.uuid4().hex[:8]}"
    admin.create_subscription(name, topic=topic, retry_policy=RetryPolicy(0, 0))
    subscriber = Subscriber(endpoints.kafka_config(), redis_url=endpoints.redis_url)
    seen, start = 0, 0.0
    while seen < count:
        messages = subscriber.pull(name, max_messages=batch, timeout=1.0)
        if messages and not start:
            start = time.perf_counter()
        subscriber.acknowledge(messages)
        seen += len(messages)
    elapsed = time.perf_counter() - start
    subscriber.close()
    return count / elapsed


def layer_ordered_consumer(endpoints: Endpoints, topic: str, count: int, batch: int = 500) -> float:
    """``OrderedConsumer`` on one thread: ``consume`` then ``ack`` each message."""
    consumer = OrderedConsumer({**endpoints.kafka_config(),
                                "group.id": f"bench-oc-{uuid.uuid4().hex[:8]}", "auto.offset.reset": "earliest",
                                "enable.auto.commit": False}, redis_url=endpoints.redis_url)
    consumer.subscribe([topic])
    seen, start = 0, 0.0
    while seen < count:
        messages = consumer.consume(batch, 1.0)
        if messages and not start:
            start = time.perf_counter()
        for message in messages:
            message.ack()
        seen += len(messages)
    elapsed = time.perf_counter() - start
    consumer.close()
    return count / elapsed


_INSIDE_SCRIPTS = {"cmdstat_hset", "cmdstat_hdel", "cmdstat_zadd", "cmdstat_zremrangebyscore", "cmdstat_info"}


def redis_round_trips(endpoints: Endpoints) -> int:
    """Commands sent by clients (those the Lua scripts run inside Redis excluded)."""
    stats = redis_client(endpoints.redis_url).info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k not in _INSIDE_SCRIPTS)


def main() -> None:
    """Run the chosen scenarios of (a)..(d) and print the figures and ratios."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--io-messages", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of (a) and (e)")
    parser.add_argument("--e-messages", type=int, default=20_000, help="messages of (e)")
    parser.add_argument("--f-messages", type=int, default=100_000, help="messages of (f), each key count")
    parser.add_argument("--g-messages", type=int, default=4_000, help="messages of (g)")
    parser.add_argument("--scenarios", default="abcde", help="which of a..h to run (d needs a)")
    args = parser.parse_args()
    with bench_stack() as endpoints:
        admin = Admin(endpoints.kafka_config(), redis_url=endpoints.redis_url)
        if "a" in args.scenarios:
            noop(endpoints, admin, args.messages, args.workers, args.rounds, "d" in args.scenarios)
        if "b" in args.scenarios:
            io_bound(endpoints, admin, args.io_messages, args.workers)
        if "c" in args.scenarios:
            head_of_line(endpoints, admin, args.workers)
        if "e" in args.scenarios:
            ordered_vs_unordered(endpoints, admin, args.e_messages, args.workers, args.rounds)
        if "f" in args.scenarios:
            coroutines(endpoints, admin, args.f_messages)
        if "g" in args.scenarios:
            cpu_bound(endpoints, admin, args.g_messages, args.workers)
        if "h" in args.scenarios:
            shape_ceiling(endpoints, admin, args.messages, args.workers, args.rounds)


def noop(endpoints: Endpoints, admin: Admin, messages: int, workers: int, rounds: int,
         round_trips: bool) -> None:
    """(a), (a') and (d): the same topic read by raw confluent-kafka and by each front end, rounds
    interleaved; medians of the per-round ratios."""
    topic = workload_topic(endpoints, admin, "bench-noop", messages)
    runs: dict[str, list[float]] = {name: [] for name in ("raw", "callback", "consume-fetch", "unleased", "pull",
                                                          "consumer")}
    per_message: list[float] = []
    for round_ in range(rounds):
        runs["raw"].append(raw_consume(endpoints, topic, messages))
        before = redis_round_trips(endpoints)
        runs["callback"].append(layer_consume(endpoints, admin, topic, messages, workers))
        per_message.append((redis_round_trips(endpoints) - before) / messages)
        os.environ["ORDERING_LAYER_NATIVE_FETCH"] = "0"  # the same, fetching through consume()
        try:
            runs["consume-fetch"].append(layer_consume(endpoints, admin, topic, messages, workers))
        finally:
            del os.environ["ORDERING_LAYER_NATIVE_FETCH"]
        runs["unleased"].append(layer_consume(endpoints, admin, topic, messages, workers, track_leases=False))
        runs["pull"].append(layer_pull(endpoints, admin, topic, messages))
        runs["consumer"].append(layer_ordered_consumer(endpoints, topic, messages))
        print(f"round {round_ + 1}: " + ", ".join(f"{name} {rates[-1]:,.0f}" for name, rates in runs.items())
              + " msg/s", flush=True)

    def ratio(layer: str, reference: str = "raw") -> float:
        return statistics.median(a / b for a, b in zip(runs[layer], runs[reference], strict=True))

    def rate(name: str) -> float:
        return statistics.median(runs[name])

    print(f"medians of {rounds} interleaved rounds:")
    print(ratio_line(f"(a) no-op, {messages} x 100 B, 10,000 keys, callback", rate("callback"), rate("raw"))
          + f"   median ratio {ratio('callback'):.3f}")
    print(ratio_line("(a) callback, fetching through consume()", rate("consume-fetch"), rate("raw"))
          + f"   median ratio {ratio('consume-fetch'):.3f}")
    print(f"    native fetch / consume(): {ratio('callback', 'consume-fetch'):.2f}")
    print(ratio_line("(a') callback, lease tracking switched off", rate("unleased"), rate("raw"))
          + f"   median ratio {ratio('unleased'):.3f}")
    print(f"    leases on / off: {ratio('callback', 'unleased'):.2f} (goal >= 0.90)")
    print(ratio_line("(a) the same, pull mode (Subscriber.pull)", rate("pull"), rate("raw"))
          + f"   median ratio {ratio('pull'):.3f}")
    print(ratio_line("(a) the same, OrderedConsumer.consume", rate("consumer"), rate("raw"))
          + f"   median ratio {ratio('consumer'):.3f}")
    if round_trips:
        print(f"(d) Redis round trips per message during (a) callback: {statistics.median(per_message):.4f} "
              "(goal <= 0.05)")


class _Wrapped:
    """What the bare shape hands to its callback thread: a record in a slots object, as a release does."""

    __slots__ = ("post", "record", "settled")

    def __init__(self, record: Any, post: Any) -> None:
        self.record = record
        self.post = post
        self.settled = False


def bare_shape(endpoints: Endpoints, topic: str, count: int, *, native: bool, max_outstanding: int = 1000) -> float:
    """(h): callback mode's threads and hand-offs, with none of the layer's bookkeeping. A fetch
    thread posts batches to a coordinator, which wraps each record, releases within
    ``max_outstanding`` and hands them to one callback thread; the callback marks each settled and
    posts it back; the coordinator counts the acks. The fetch is ``consume(500)`` like
    ``raw_consume``'s, or with ``native`` the layer's own (``open_native_fetch``: ``Record``s made
    straight from librdkafka's queues). Returns msg/s from the first callback to the last ack."""
    config = {**endpoints.kafka_config(), "group.id": f"shape-{uuid.uuid4().hex}", "enable.auto.commit": False,
              "auto.offset.reset": "earliest", "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS}
    consumer = Consumer(config)
    fast = open_native_fetch(consumer, config, topic, lambda record: None) if native else None
    if native and fast is None:
        raise RuntimeError("the native fetch is not available here")

    def assigned(_: Consumer, partitions: list[TopicPartition]) -> None:
        if fast is not None:
            fast.attach([tp.partition for tp in partitions])

    consumer.subscribe([topic], on_assign=assigned)
    inbox: collections.deque[Any] = collections.deque()
    work: collections.deque[_Wrapped] = collections.deque()
    events, handed = threading.Condition(threading.Lock()), threading.Condition(threading.Lock())
    finished, stop = threading.Event(), threading.Event()
    first = [0.0]

    def post(item: Any) -> None:
        inbox.append(item)
        if len(inbox) == 1:
            with events:
                events.notify()

    def fetch() -> None:
        while not stop.is_set():
            if len(inbox) > 40:  # batches the coordinator has not taken yet
                time.sleep(0.001)
                continue
            if fast is None:
                batch = consumer.consume(500, 0.1)
            else:
                consumer.consume(500, 0)  # events only: the partitions' records are fetched natively
                batch, _ = fast.fetch(500, 0.1)
            if batch:
                post(batch)

    def coordinate() -> None:
        fetched: collections.deque[Any] = collections.deque()
        outstanding = acked = 0
        while acked < count:
            with events:
                if not inbox:
                    events.wait(0.05)
            for event in [inbox.popleft() for _ in range(len(inbox))]:
                if type(event) is list:
                    fetched.extend(event)
                else:
                    outstanding -= 1
                    acked += 1
            released = [_Wrapped(fetched.popleft(), post) for _ in range(min(len(fetched),
                                                                               max_outstanding - outstanding))]
            if released:
                outstanding += len(released)
                work.extend(released)
                with handed:
                    handed.notify()
        finished.set()

    def call_back() -> None:
        while not finished.is_set():
            try:
                message = work.popleft()
            except IndexError:
                with handed:
                    if not work:
                        handed.wait(0.05)
                continue
            if not first[0]:
                first[0] = time.perf_counter()
            message.settled = True
            message.post(message)

    threads = [threading.Thread(target=target, daemon=True) for target in (fetch, coordinate, call_back)]
    for thread in threads:
        thread.start()
    finished.wait(600)
    elapsed = time.perf_counter() - first[0]
    stop.set()
    for thread in threads:
        thread.join()
    if fast is not None:
        fast.close()
    consumer.close()
    return count / elapsed


def shape_ceiling(endpoints: Endpoints, admin: Admin, messages: int, workers: int, rounds: int) -> None:
    """(h): the raw loop, the bare shape and the layer's callback mode on one topic, rounds
    interleaved; medians of the per-round ratios."""
    topic = workload_topic(endpoints, admin, "bench-shape", messages)
    runs: dict[str, list[float]] = {"raw": [], "bare shape": [], "bare, native fetch": [], "callback": []}
    for round_ in range(rounds):
        runs["raw"].append(raw_consume(endpoints, topic, messages))
        runs["bare shape"].append(bare_shape(endpoints, topic, messages, native=False))
        runs["bare, native fetch"].append(bare_shape(endpoints, topic, messages, native=True))
        runs["callback"].append(layer_consume(endpoints, admin, topic, messages, workers))
        print(f"round {round_ + 1}: " + ", ".join(f"{name} {rates[-1]:,.0f}" for name, rates in runs.items())
              + " msg/s", flush=True)

    def ratio(layer: str, reference: str = "raw") -> float:
        return statistics.median(a / b for a, b in zip(runs[layer], runs[reference], strict=True))

    print(f"medians of {rounds} interleaved rounds:")
    print(ratio_line("(h) bare shape (no bookkeeping)", statistics.median(runs["bare shape"]),
                     statistics.median(runs["raw"])) + f"   median ratio {ratio('bare shape'):.3f}")
    print(ratio_line("(h) bare shape, native fetch", statistics.median(runs["bare, native fetch"]),
                     statistics.median(runs["raw"])) + f"   median ratio {ratio('bare, native fetch'):.3f}")
    print(ratio_line("(h) callback mode", statistics.median(runs["callback"]), statistics.median(runs["raw"]))
          + f"   median ratio {ratio('callback'):.3f}")
    print(f"    callback mode / bare shape with the native fetch: {ratio('callback', 'bare, native fetch'):.2f}")
    steps: list[tuple[float, int]] = []
    with step_costs(steps):
        rate = layer_consume(endpoints, admin, topic, messages, workers)
    busy = [(cpu, work) for cpu, work in steps if work]
    per_message, fixed = statistics.linear_regression([work / 3 for _, work in busy], [cpu for cpu, _ in busy])
    total_cpu, total_work = sum(cpu for cpu, _ in busy), sum(work for _, work in busy) / 3
    print(f"(h) the coordinator, one more callback pass ({rate:,.0f} msg/s): {len(busy)} steps, "
          f"{total_work / len(busy):.0f} messages a step, thread CPU {total_cpu / total_work * 1e6:.2f} us a message "
          f"= {fixed * 1e6:.0f} us a step + {per_message * 1e6:.2f} us a message (least squares; a message is "
          "taken in, released and acked, a third of its work each)")


@contextlib.contextmanager
def step_costs(steps: list[tuple[float, int]]) -> Iterator[None]:
    """For engines made inside: each coordinator step's thread CPU time and its work (records taken
    in + messages released + acks applied) appended to ``steps``."""
    step, take = Engine._step, Partitions.take
    taken = [0]

    def timed_step(self: Engine) -> float:
        counts = self._counts
        taken[0], before, start = 0, counts["delivered"] + counts["acked"], time.thread_time()
        try:
            return step(self)
        finally:
            steps.append((time.thread_time() - start, taken[0] + counts["delivered"] + counts["acked"] - before))

    def counted_take(self: Partitions, fetched: Any) -> None:
        taken[0] += len(fetched.records)
        take(self, fetched)

    Engine._step, Partitions.take = timed_step, counted_take  # type: ignore[method-assign]
    try:
        yield
    finally:
        Engine._step, Partitions.take = step, take  # type: ignore[method-assign]


def ordered_vs_unordered(endpoints: Endpoints, admin: Admin, messages: int, workers: int, rounds: int) -> None:
    """(e): 10,000 keys, 1 ms handler: an ordered subscription vs an unordered one, same topic."""
    topic = workload_topic(endpoints, admin, "bench-order", messages)
    ratios: list[float] = []
    for round_ in range(rounds):
        ordered = layer_consume(endpoints, admin, topic, messages, workers, handler=lambda _m: time.sleep(0.001))
        unordered = layer_consume(endpoints, admin, topic, messages, workers, handler=lambda _m: time.sleep(0.001),
                                  ordered=False)
        ratios.append(ordered / unordered)
        print(f"(e) round {round_ + 1}: ordered {ordered:,.0f} msg/s, unordered {unordered:,.0f} msg/s, "
              f"ratio {ordered / unordered:.2f}", flush=True)
    print(f"(e) 1 ms handler, 10,000 keys, {workers} workers: ordered / unordered, median of {rounds} rounds: "
          f"{statistics.median(ratios):.2f} (goal >= 0.9)")


def io_bound(endpoints: Endpoints, admin: Admin, io_messages: int, workers: int) -> None:
    """(b): one partition, 5 ms handler, K = 1, 20, 1000 keys vs a one-at-a-time consumer."""
    plain_rate = None
    for keys in (1, 20, 1000):
        topic = f"bench-io-{keys}-{uuid.uuid4().hex[:8]}"
        admin.create_topic(topic, partitions=1)
        publish(endpoints, topic, [f"key-{i}" for i in range(keys)], io_messages)
        if plain_rate is None:
            plain_rate = raw_consume(endpoints, topic, io_messages, 0.005, one_at_a_time=True)
        rate = layer_consume(endpoints, admin, topic, io_messages, workers,
                             handler=lambda _m: time.sleep(0.005))
        goal = 0.8 * min(keys, workers)
        print(f"(b) 5 ms handler, 1 partition, K={keys:<5} layer {rate:8,.0f} msg/s   one-at-a-time "
              f"{plain_rate:6,.0f} msg/s   speedup {rate / plain_rate:5.1f} (goal >= {goal:.1f})")


def head_of_line(endpoints: Endpoints, admin: Admin, workers: int) -> None:
    """(c): fast keys' throughput with one 1 s key in their partition vs without it."""
    fast_keys = [f"fast-{i}" for i in range(200)]
    fast_count = 200 * 20
    baseline_topic = f"bench-hol-base-{uuid.uuid4().hex[:8]}"
    admin.create_topic(baseline_topic, partitions=1)
    publish(endpoints, baseline_topic, fast_keys, fast_count)
    slow_topic = f"bench-hol-slow-{uuid.uuid4().hex[:8]}"
    admin.create_topic(slow_topic, partitions=1)
    publish(endpoints, slow_topic, [*fast_keys[:100], "slow", *fast_keys[100:]], fast_count + 20)

    def work(message: Message) -> None:
        time.sleep(1.0 if message.ordering_key == "slow" else 0.001)

    fast_done = {"n": 0}

    def fast_finished(message: Message) -> bool:
        if message.ordering_key != "slow":
            fast_done["n"] += 1
        return fast_done["n"] >= fast_count

    without = layer_consume(endpoints, admin, baseline_topic, fast_count, workers, handler=work)
    with_slow = layer_consume(endpoints, admin, slow_topic, fast_count, workers, handler=work,
                              done_when=fast_finished)
    print(ratio_line("(c) fast keys with a 1 s key in the partition", with_slow, without))


def acked_rate(handle: Any, count: int) -> float:
    """msg/s of a running subscription from its first ack to its ``count``-th, read from the
    engine's settle counter every millisecond (callbacks in worker processes are acked by the
    subscriber, not by code of this benchmark)."""
    counts = handle.engine._counts  # a dict the coordinator updates; read without its lock
    while counts["acked"] == 0:
        time.sleep(0.001)
    first = time.perf_counter()
    deadline = first + 600
    while counts["acked"] < count and time.perf_counter() < deadline:
        time.sleep(0.001)
    return count / (time.perf_counter() - first)


def subscribed_rate(endpoints: Endpoints, admin: Admin, topic: str, count: int, callback: Any, **options: Any) -> float:
    """A new subscription of ``topic`` read through ``subscribe(callback, **options)``: ``acked_rate``."""
    name = f"bench-{uuid.uuid4().hex[:8]}"
    admin.create_subscription(name, topic=topic, retry_policy=RetryPolicy(0, 0))
    subscriber = Subscriber(endpoints.kafka_config(), redis_url=endpoints.redis_url)
    handle = subscriber.subscribe(name, callback, **options)
    try:
        return acked_rate(handle, count)
    finally:
        handle.cancel()


async def sleep_then_ack(message: Message) -> None:
    """(f)'s callback."""
    await asyncio.sleep(0.005)
    message.ack()


def coroutines(endpoints: Endpoints, admin: Admin, messages: int) -> None:
    """(f): a coroutine callback awaiting 5 ms then acking, 100 and 1,000 keys, 6 partitions."""
    for keys, goal in ((100, 15_000), (1000, 40_000)):
        topic = f"bench-aio-{keys}-{uuid.uuid4().hex[:8]}"
        admin.create_topic(topic, partitions=6)
        publish(endpoints, topic, [f"key-{i}" for i in range(keys)], messages)
        rate = subscribed_rate(endpoints, admin, topic, messages, sleep_then_ack,
                               flow_control=FlowControl(max_messages=1000))
        print(f"(f) coroutine, 5 ms await, 6 partitions, K={keys:<5} {rate:10,.0f} msg/s   ceiling "
              f"{min(keys, 1000) / 0.005:8,.0f}   goal >= {goal:,}", flush=True)


def burn(iterations: int) -> int:
    """Pure-Python CPU work (holds the interpreter lock throughout)."""
    total = 0
    for i in range(iterations):
        total = (total * 31 + i) % 1_000_003
    return total


def burn_message(iterations: int, message: Any) -> None:
    """(g)'s callback, in a thread (then acked here) or a worker process (picklable with
    ``functools.partial``: returning acks)."""
    burn(iterations)
    if isinstance(message, Message):
        message.ack()


def calibrate(seconds: float) -> int:
    """``burn`` iterations taking about ``seconds`` of CPU time (the thread's own: the calibration
    holds on a machine busy with other work)."""
    iterations = 10_000
    while True:
        began = time.thread_time()
        burn(iterations)
        took = time.thread_time() - began
        if took > 0.2:
            return max(1, int(iterations * seconds / took))
        iterations *= 2


def cpu_bound(endpoints: Endpoints, admin: Admin, messages: int, workers: int) -> None:
    """(g): a ~2 ms pure-Python callback over 200 keys: ProcessPoolExecutor(2) vs the thread pool."""
    iterations = calibrate(0.002)
    topic = f"bench-cpu-{uuid.uuid4().hex[:8]}"
    admin.create_topic(topic, partitions=6)
    publish(endpoints, topic, [f"key-{i}" for i in range(200)], messages)
    callback = functools.partial(burn_message, iterations)
    cpu = time.process_time()
    threads = subscribed_rate(endpoints, admin, topic, messages, callback, max_workers=workers)
    thread_cpu, cpu = (time.process_time() - cpu) / messages, time.process_time()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    with ProcessPoolExecutor(2) as pool:
        list(pool.map(burn, [1, 1]))  # the processes started before the clock
        processes = subscribed_rate(endpoints, admin, topic, messages, callback, executor=pool)
    parent_cpu = (time.process_time() - cpu) / messages
    ended = resource.getrusage(resource.RUSAGE_CHILDREN)  # the pool's processes, ended with it
    worker_cpu = (ended.ru_utime + ended.ru_stime - children.ru_utime - children.ru_stime) / messages
    print(f"(g) ~2 ms CPU-bound callback ({iterations:,} iterations), 200 keys: ProcessPoolExecutor(2) "
          f"{processes:8,.0f} msg/s   thread pool ({workers}) {threads:8,.0f} msg/s   ratio {processes / threads:5.2f} "
          "(goal >= 1.6)", flush=True)
    print(f"    CPU per message: threads {thread_cpu * 1e6:,.0f} us; processes: subscriber {parent_cpu * 1e6:,.0f} us, "
          f"workers {worker_cpu * 1e6:,.0f} us (the whole runs, subscribing and cancelling included)", flush=True)


if __name__ == "__main__":
    main()
