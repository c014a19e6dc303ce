"""How fast can a per-key ordered, per-message acked subscriber go in this process model? (issue 11)

The subscriber's CPU table (``bench/RESULTS.md``) says the pure-Python engine cannot reach 0.25x of
the raw consume loop, and a projection said that even the compiled core leaves it short. This
script measures instead of projecting: bench (a)'s workload (100 B, 10,000 keys, 6 partitions) on a
real broker, each reader its own group from the earliest offset, rounds interleaved, read by

* ``raw``: bench_subscribe's raw loop (``consume(500)``, count, async commit per batch);
* ``python-floor``: the raw loop plus what any per-message Python API must do and nothing else: a
  slotted ``Message`` per record, the user's no-op callback, ``Message.ack`` appending to a list;
  no ordering, no bookkeeping: the ceiling of every design that keeps confluent-kafka's ``consume``;
* ``core-inline``: per-key ordered dispatch with the compiled core, one thread: the core reads the
  confluent messages itself (``kafka_partition_runs``, ``PartitionCore.add_kafka``), releases
  ready keys (one message per key at a time, 1,000 outstanding at most, leases as batch ops), the
  callback runs inline, acks go back into the core per partition, the packed Redis ops go out in
  one round trip per step (a ``SET`` of the same string: the client-side cost of the real flush,
  not the Lua), commits per batch at the core's commit point;
* ``core-threaded N``: the same with the callbacks on N threads: the fetch thread hands released
  runs over a queue in chunks, callbacks ack by appending to a deque the fetch thread drains: the
  process model of the subscriber (fetch and bookkeeping on one thread, user code on a pool);
* ``library-threaded 16``: ``core-threaded 16`` with the library's own per-message objects around
  the core (``to_record``, the library's ``Message``, the lease table): what
  remains of the engine's Python per message if only the bookkeeping is compiled;
* ``library-split 16``: ``library-threaded 16`` with the fetch (``consume``, ``to_record``) on a
  thread of its own posting batches to the bookkeeping thread, as the subscriber has it: what the
  third thread costs.

Printed: msg/s per reader and round, the median of the per-round ratios to ``raw``, and the process
CPU per message (all threads, librdkafka's included; from the first ``consume`` to ``close``), which
bounds a reader whose Python threads share one GIL whatever the broker's fetch pace.

``--fetch-queue-backoff-ms`` sets librdkafka's ``fetch.queue.backoff.ms`` in every reader: at its
default (1 s) a reader that spends time between ``consume`` calls (a Redis round trip per batch is
enough) meets a 1 s fetch stall in most runs, which caps a 200,000-message run at ~150-175k msg/s.

    PYTHONPATH=. .venv/bin/python bench/profile_floor.py [--messages 200000] [--rounds 3]
        [--fetch-queue-backoff-ms 10]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import queue
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, TopicPartition

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_subscribe import raw_consume, workload_topic
from bench.common import bench_stack
from ordering_layer import Admin, Message
from ordering_layer._core import PartitionCore, kafka_partition_runs, partition_runs
from ordering_layer.config import SubscriptionSettings
from ordering_layer.stack import Endpoints
from ordering_layer.state.client import redis_client
from ordering_layer.subscriber.fetched import to_record
from ordering_layer.subscriber.leases import lease_table

MAX_OUTSTANDING = 1000
MAX_BYTES = 100 * 1024 * 1024
LEASE_MS = 60_000
CHUNK = 64


class FloorMessage:
    """The least a delivered message can be: its record, token and attempt, and an ack."""

    __slots__ = ("_acks", "data", "delivery_attempt", "partition", "record", "token")

    def __init__(self, record: Any, partition: int, token: int, attempt: int, acks: Any) -> None:
        self.record = record
        self.partition = partition
        self.token = token
        self.delivery_attempt = attempt
        self.data = record.value()
        self._acks = acks

    def ack(self) -> None:
        self._acks.append(self)


def noop(message: Any) -> None:
    message.ack()


def _consumer(endpoints: Endpoints, topic: str) -> Consumer:
    consumer = Consumer({**endpoints.kafka_config(), "group.id": f"floor-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    return consumer


def python_floor(endpoints: Endpoints, topic: str, count: int) -> float:
    consumer = _consumer(endpoints, topic)
    acks: list[FloorMessage] = []
    seen = 0
    start = 0.0
    while seen < count:
        batch = consumer.consume(500, 1.0)
        if not batch:
            continue
        start = start or time.perf_counter()
        for record in batch:
            if record.error() is None:
                noop(FloorMessage(record, 0, 0, 1, acks))
        seen += len(acks)
        acks.clear()
        consumer.commit(asynchronous=True)
    elapsed = time.perf_counter() - start
    consumer.close()
    return count / elapsed


class CoreReader:
    """Ordered dispatch through the compiled core on the fetch thread (see the module's text)."""

    def __init__(self, endpoints: Endpoints, topic: str, workers: int) -> None:
        self.topic = topic
        self.consumer = _consumer(endpoints, topic)
        self.redis = redis_client(endpoints.redis_url)
        self.scratch = f"floor-ops-{uuid.uuid4().hex}"
        self.cores: dict[int, PartitionCore[Any]] = {}
        self.outstanding = 0
        self.settled = 0
        self.acks: collections.deque[FloorMessage] = collections.deque()
        self.workers = workers
        self.work: queue.SimpleQueue[list[FloorMessage] | None] = queue.SimpleQueue()

    def core(self, partition: int) -> PartitionCore[Any]:
        core = self.cores.get(partition)
        if core is None:
            core = self.cores[partition] = PartitionCore(ordered=True)
        return core

    def released(self, now: float) -> Iterator[tuple[int, list[Any], list[int], list[int]]]:
        """(partition, records, tokens, attempts) released by each core in turn, within the budget."""
        for partition, core in self.cores.items():
            budget = MAX_OUTSTANDING - self.outstanding
            if budget <= 0:
                return
            records, tokens, attempts, _bytes, _suspects, _handles = core.release_ready(
                now, budget, 1, MAX_BYTES, LEASE_MS, pooled=True)
            if records:
                self.outstanding += len(records)
                yield partition, records, tokens, attempts

    def release(self, deliver: Callable[[list[Any]], None]) -> None:
        acks = self.acks
        for partition, records, tokens, attempts in self.released(time.monotonic()):
            deliver([FloorMessage(record, partition, token, attempt, acks)
                     for record, token, attempt in zip(records, tokens, attempts, strict=True)])

    def settle(self) -> None:
        acks = self.acks
        per_partition: dict[int, tuple[list[int], list[int]]] = {}
        while acks:
            message = acks.popleft()
            offsets, tokens = per_partition.setdefault(message.partition, ([], []))
            offsets.append(message.record.offset())
            tokens.append(message.token)
        self.ack(per_partition)

    def ack(self, per_partition: dict[int, tuple[list[int], list[int]]]) -> None:
        """Acks (offsets, tokens) into each partition's core; commit the new commit points."""
        commits = []
        for partition, (offsets, tokens) in per_partition.items():
            refused, watermark = self.cores[partition].ack(offsets, tokens)
            assert not refused
            self.outstanding -= len(offsets)
            self.settled += len(offsets)
            if watermark is not None:
                commits.append(TopicPartition(self.topic, partition, watermark))
        if commits:
            self.commit(commits)

    def commit(self, offsets: list[TopicPartition]) -> None:
        """Commit asynchronously (on this thread: it owns the consumer)."""
        self.consumer.commit(offsets=offsets, asynchronous=True)

    def flush_ops(self) -> None:
        ops = "".join(core.take_ops() for core in self.cores.values() if core.ops_count)
        if ops:
            self.redis.set(self.scratch, ops)

    def take(self, batch: list[Any]) -> None:
        for partition, begin, end in kafka_partition_runs(batch):
            self.core(partition).add_kafka(batch, begin, end)

    def inline(self, count: int) -> float:
        start = 0.0

        def deliver(messages: list[FloorMessage]) -> None:
            for message in messages:
                noop(message)

        while self.settled < count:
            batch = self.consumer.consume(500, 0.1)
            if batch:
                start = start or time.perf_counter()
                self.take(batch)
            while True:  # release until no key is ready: every callback acks inline
                self.release(deliver)
                if not self.acks:
                    break
                self.settle()
            self.flush_ops()
        return self._finish(count, start)

    def threaded(self, count: int) -> float:
        start = 0.0
        work = self.work

        def deliver(messages: list[FloorMessage]) -> None:
            for begin in range(0, len(messages), CHUNK):
                work.put(messages[begin:begin + CHUNK])

        def run() -> None:
            while (chunk := work.get()) is not None:
                for message in chunk:
                    noop(message)

        threads = [threading.Thread(target=run, daemon=True) for _ in range(self.workers)]
        for thread in threads:
            thread.start()
        while self.settled < count:
            full = self.outstanding >= MAX_OUTSTANDING
            batch = [] if full else self.next_batch(0.0 if self.outstanding else 0.1)
            if batch:
                start = start or time.perf_counter()
                self.take(batch)
            self.settle()
            self.release(deliver)
            self.flush_ops()
            if full and self.waiting():
                time.sleep(0.0005)  # the pool works; the real engine waits on its inbox instead
        for _ in threads:
            work.put(None)
        return self._finish(count, start)

    def next_batch(self, timeout: float) -> list[Any]:
        """The next fetched batch (``threaded``): here a ``consume`` on this thread."""
        return self.consumer.consume(500, timeout)

    def waiting(self) -> bool:
        """Nothing to settle yet."""
        return not self.acks

    def _finish(self, count: int, start: float) -> float:
        elapsed = time.perf_counter() - start
        self.consumer.close()
        self.redis.delete(self.scratch)
        return count / elapsed


class _Owned:
    """A partition as the lease table looks it up: its core and owner epoch."""

    __slots__ = ("core", "epoch")

    def __init__(self, core: PartitionCore[Any]) -> None:
        self.core, self.epoch = core, 1


class LibraryReader(CoreReader):
    """``CoreReader`` with the library's per-message objects around the core: ``to_record`` at the
    fetch (ol- metadata read), the library's ``Message`` at the release (its ``ack`` posts the
    message itself), the engine's lease table (admit per released run, a run of acks settled in one
    call): what the engine keeps of Python per message."""

    def __init__(self, endpoints: Endpoints, topic: str, workers: int) -> None:
        super().__init__(endpoints, topic, workers)
        self.leases = lease_table(SubscriptionSettings(topic=topic))
        self.owned: dict[int, _Owned] = {}
        self.library_acks: collections.deque[Any] = collections.deque()  # plain acks post the Message

    def take(self, batch: list[Any]) -> None:
        records = [to_record(msg) for msg in batch if msg.error() is None]
        for partition, begin, end in partition_runs(records):
            self.core(partition).add(records, begin, end)

    def release(self, deliver: Callable[[list[Any]], None]) -> None:
        now = time.monotonic()
        post = self.library_acks.append
        for partition, records, tokens, attempts in self.released(now):
            if partition not in self.owned:
                self.owned[partition] = _Owned(self.core(partition))
            handles = self.leases.admit(partition, 1, [record.offset for record in records], tokens,
                                        [record.size for record in records], now)
            messages = [Message(record, record.key, token, attempt, self.topic, 1, post, handle)
                        for record, token, attempt, handle in zip(records, tokens, attempts, handles, strict=True)]
            deliver(messages)

    def settle(self) -> None:
        acks = self.library_acks
        run = [acks.popleft() for _ in range(len(acks))]
        settled = self.leases.ack_run(run, self.owned, time.monotonic())
        self.outstanding -= settled
        self.settled += settled
        commits = [TopicPartition(self.topic, partition, watermark) for partition, core in self.cores.items()
                   if (watermark := core.watermark) is not None]
        if commits:
            self.commit(commits)

    def waiting(self) -> bool:
        return not self.library_acks


class SplitReader(LibraryReader):
    """``LibraryReader`` with the fetch on a thread of its own, as the subscriber has it: ``consume``
    and ``to_record`` on the fetch thread, record batches posted to a deque that the bookkeeping
    thread drains, the fetch waiting while 2,000 records it posted are not taken
    (``FlowGate.max_in_flight``): what the third thread costs."""

    def __init__(self, endpoints: Endpoints, topic: str, workers: int) -> None:
        super().__init__(endpoints, topic, workers)
        self.posted: collections.deque[list[Any]] = collections.deque()
        self.commits: collections.deque[list[TopicPartition]] = collections.deque()
        self.stopping = threading.Event()
        self.fetcher = threading.Thread(target=self.fetch, daemon=True)

    def fetch(self) -> None:
        posted, commits = self.posted, self.commits
        while not self.stopping.is_set():
            while commits:  # commits reach the consumer's thread as queued requests, as in the subscriber
                self.consumer.commit(offsets=commits.popleft(), asynchronous=True)
            if len(posted) >= 4:
                time.sleep(0.0005)  # the subscriber's fetch thread polls its gate the same way
                continue
            records = [to_record(msg) for msg in self.consumer.consume(500, 0.1) if msg.error() is None]
            if records:
                posted.append(records)

    def commit(self, offsets: list[TopicPartition]) -> None:
        self.commits.append(offsets)

    def next_batch(self, timeout: float) -> list[Any]:
        if self.posted:
            return self.posted.popleft()
        time.sleep(0.0005)  # waiting for the fetch thread (the subscriber's coordinator waits on its inbox)
        return []

    def take(self, batch: list[Any]) -> None:
        for partition, begin, end in partition_runs(batch):
            self.core(partition).add(batch, begin, end)

    def threaded(self, count: int) -> float:
        self.fetcher.start()
        return super().threaded(count)

    def _finish(self, count: int, start: float) -> float:
        self.stopping.set()
        self.fetcher.join()
        return super()._finish(count, start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fetch-queue-backoff-ms", type=int, default=None,
                        help="set librdkafka's fetch.queue.backoff.ms (default 1000) in every reader, raw included")
    parser.add_argument("--readers", default=None,
                        help="comma-separated reader names to run (raw is always run); default: all")
    args = parser.parse_args()
    readers: dict[str, Callable[[Endpoints, str, int], float]] = {
        "raw": raw_consume,
        "python-floor": python_floor,
        "core-inline": lambda e, t, n: CoreReader(e, t, 1).inline(n),
        "core-threaded 1": lambda e, t, n: CoreReader(e, t, 1).threaded(n),
        "core-threaded 16": lambda e, t, n: CoreReader(e, t, 16).threaded(n),
        "library-threaded 16": lambda e, t, n: LibraryReader(e, t, 16).threaded(n),
        "library-split 16": lambda e, t, n: SplitReader(e, t, 16).threaded(n),
    }
    if args.readers:
        wanted = {"raw", *args.readers.split(",")}
        readers = {name: read for name, read in readers.items() if name in wanted}
    with bench_stack() as stack, tempfile.TemporaryDirectory() as scratch:
        endpoints = stack
        if args.fetch_queue_backoff_ms is not None:
            properties = Path(scratch) / "client.properties"
            properties.write_text(f"fetch.queue.backoff.ms={args.fetch_queue_backoff_ms}\n")
            endpoints = dataclasses.replace(stack, kafka_config_file=str(properties))
        admin = Admin(endpoints.kafka_config(), redis_url=endpoints.redis_url)
        topic = workload_topic(endpoints, admin, "bench-floor", args.messages)
        runs: dict[str, list[float]] = {name: [] for name in readers}
        cpu: dict[str, list[float]] = {name: [] for name in readers}
        for round_ in range(args.rounds):
            for name, read in readers.items():
                before = time.process_time()
                runs[name].append(read(endpoints, topic, args.messages))
                cpu[name].append((time.process_time() - before) / args.messages * 1e6)
            print(f"round {round_ + 1}: " + ", ".join(f"{name} {rates[-1]:,.0f}" for name, rates in runs.items())
                  + " msg/s", flush=True)
        print(f"\n{args.messages:,} x 100 B, 10,000 keys, 6 partitions; median of {args.rounds} rounds")
        print(f"{'reader':<18} {'msg/s':>10} {'ratio to raw':>13} {'CPU us/msg':>11} {'raw/this CPU':>13}")
        for name, rates in runs.items():
            ratio = statistics.median(a / b for a, b in zip(rates, runs["raw"], strict=True))
            per_message = statistics.median(cpu[name])
            print(f"{name:<18} {statistics.median(rates):>10,.0f} {ratio:>13.3f} {per_message:>11.2f}"
                  f" {statistics.median(cpu['raw']) / per_message:>13.3f}")


if __name__ == "__main__":
    main()
