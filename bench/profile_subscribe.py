"""Per-message CPU cost of the subscriber's hot path, callback mode, bench (a) workload (issue 11).

CPU time, not wall time: it holds on a machine shared with other work. Three sources:

* per-thread CPU clocks (``pthread_getcpuclockid``) of the fetch thread, the engine thread and the
  callback threads, read while they run; librdkafka's own threads are the rest of the process;
* probes: named engine methods that run once per batch are wrapped with ``thread_time`` counters
  (two clock reads per batch, never per message); ``PROBES`` names them;
* micro-measurements on the run's own records for the per-message steps that are not batched
  (``to_record``, metadata read, a user's ``ack``), timed over a copy of the fetched messages.

    .venv/bin/python bench/profile_subscribe.py [--messages 200000] [--workers 16] [--consume-fetch]
        [--no-leases]

``--no-leases`` profiles the subscriber with lease tracking switched off (``track_leases=False``,
bench (a')), for a table of what lease tracking costs. Below the table: the CPU the Redis server and
the Kafka broker used over the run (read from ``/proc``: the Redis by the port of the stack's URL,
the brokers as the ``kafka.Kafka`` processes), per message, and the garbage collector's time.

The subscriber fetches natively (``native_fetch``) where it can; ``--consume-fetch`` profiles it
fetching through ``consume()`` (``ORDERING_LAYER_NATIVE_FETCH=0``), whose fetch loop makes a
``Record`` per message with ``to_record`` (a row of its own then).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from confluent_kafka import Consumer
from confluent_kafka import Message as KafkaMessage

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_subscribe import workload_topic
from bench.common import bench_stack
from ordering_layer import Admin, FlowControl, Message, RetryPolicy, Subscriber
from ordering_layer.record import read_metadata
from ordering_layer.stack import Endpoints
from ordering_layer.subscriber import commits, dispatch, fetched, ownership, partitions, settlement

_SAMPLE = 50_000

# (row, owner, method): engine steps that run once per batch, timed on the thread that runs them.
PROBES: list[tuple[str, Any, str]] = [
    ("queueing (fetched batch -> partition key queues)", partitions.Partitions, "take"),
    ("release (ready keys -> deliveries, made outstanding)", dispatch.Dispatcher, "release"),
    ("acks (runs of plain acks settled)", settlement.Settlement, "acks"),
    ("start notes", settlement.Settlement, "write_starts"),
    ("leases (expiry, extension)", settlement.Settlement, "expire"),
    ("Redis op encoding + flush (client side)", ownership.Ownership, "flush"),
    ("hand-off (Message objects, callback pool)", dispatch.Dispatcher, "hand_out"),
    ("commit", commits.Commits, "offsets"),
]


def thread_role(name: str) -> str:
    """Which part of the subscriber a thread is, by its name."""
    for role in ("fetch", "engine", "cb"):
        if name.startswith(f"ordering-layer-{role}-"):
            return role
    return "other"


def micro_costs(sample: list[KafkaMessage]) -> dict[str, float]:
    """CPU seconds per message of the per-message steps, over fetched messages."""
    records = [fetched.to_record(m) for m in sample]
    posted: deque[Any] = deque(maxlen=1000)  # an inbox the engine keeps draining
    messages = [Message(r, r.key or r.offset, 1, 1, "t", 1, posted.append) for r in records]
    return {
        "to_record": per_message(fetched.to_record, sample),
        "metadata": per_message(lambda m: read_metadata(m.headers()), sample),
        "ack": per_message(Message.ack, messages),
    }


def table(figures: dict[str, float], probed: dict[str, float], micro: dict[str, float],
          count: int, native: bool) -> list[tuple[str, float]]:
    """(row, CPU seconds in all) for the run."""
    rows: list[tuple[str, float]] = []
    fetch = figures.get("thread:fetch", 0.0)
    rows.append(("fetch thread", fetch))
    if native:
        rows.append(("  native fetch (copied without the GIL, Records made in the core) and the loop", fetch))
        rows.append(("  (to_record over consume()'s messages, the fetch without it: for reference)",
                     micro["to_record"] * count))
    else:
        rows.append(("  consume() and the rest of the fetch loop", fetch - micro["to_record"] * count))
        rows.append(("  to_record (Record and metadata read, as the fetch does them)", micro["to_record"] * count))
    rows.append(("  (read_metadata alone, uncached: for reference)", micro["metadata"] * count))
    engine = figures.get("thread:engine", 0.0)
    rows.append(("engine thread", engine))
    accounted = 0.0
    for label, _owner, _name in PROBES:
        seconds = probed.get(label, 0.0)
        rows.append((f"  {label}", seconds))
        accounted += seconds
    rows.append(("  inbox, loop, the rest", engine - accounted))
    callbacks = figures.get("thread:cb", 0.0)
    rows.append(("callback threads", callbacks))
    rows.append(("  Message.ack (request + inbox post)", micro["ack"] * count))
    rows.append(("  pool take + user callback (the rest)", callbacks - micro["ack"] * count))
    python = fetch + engine + callbacks + figures.get("thread:other", 0.0)
    rows.append(("other Python threads", figures.get("thread:other", 0.0)))
    rows.append(("librdkafka threads and main thread (process - Python threads)", figures["process"] - python))
    rows.append(("process total", figures["process"]))
    return rows


class Probe:
    """Wraps methods with thread-CPU counters (per call; only methods that run once per batch)."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, label: str, owner: Any, name: str) -> None:
        original = getattr(owner, name)
        cpu, calls, clock = self.cpu, self.calls, time.thread_time

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return original(*args, **kwargs)
            finally:
                cpu[label] += clock() - start
                calls[label] += 1

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def undo(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)


def thread_cpu(threads: list[threading.Thread]) -> float:
    total = 0.0
    for thread in threads:
        if thread.ident is not None and thread.is_alive():
            total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return total


def fetched_sample(endpoints: Endpoints, topic: str, count: int) -> tuple[list[KafkaMessage], float]:
    """Messages as ``consume`` returns them, and the raw loop's process CPU per message."""
    consumer = Consumer({"bootstrap.servers": endpoints.bootstrap, "group.id": f"raw-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    kept: list[KafkaMessage] = []
    seen, start = 0, 0.0
    while seen < count:
        batch = consumer.consume(500, 1.0)
        if batch and not start:
            start = time.process_time()
        for msg in batch:
            if msg.error() is None:
                seen += 1
                if len(kept) < _SAMPLE:
                    kept.append(msg)
        if batch:
            consumer.commit(asynchronous=True)
    cpu = time.process_time() - start
    consumer.close()
    return kept, cpu / count


def per_message(step: Callable[[Any], Any], items: list[Any]) -> float:
    start = time.process_time()
    for item in items:
        step(item)
    return (time.process_time() - start) / len(items)


def services_cpu(redis_url: str) -> dict[str, float]:
    """CPU seconds used so far by the local Redis server serving ``redis_url`` and by the Kafka
    brokers on this machine (``kafka.Kafka`` processes), read from ``/proc``."""
    port = str(urlparse(redis_url).port or 6379)
    used = {"redis": 0.0, "kafka": 0.0}
    for stat in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = stat.read_bytes()  # Redis rewrites its title: "redis-server host:port", one argument
            fields = (stat.parent / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        service = "redis" if b"redis-server" in line and f":{port}".encode() in line else \
            "kafka" if b"kafka.Kafka" in line else None
        if service is not None:
            used[service] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return used


class GcClock:
    """Wall time inside the garbage collector, by generation (``gc.callbacks``; it holds the GIL)."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = defaultdict(float)
        self.runs: dict[int, int] = defaultdict(int)
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._start
            self.runs[info["generation"]] += 1


def callback_run(endpoints: Endpoints, admin: Admin, topic: str, count: int, workers: int,
                 *, track_leases: bool = True) -> tuple[dict[str, float], bool]:
    """The CPU figures of one callback-mode run, and whether its fetch was native."""
    name = f"profile-{uuid.uuid4().hex[:8]}"
    admin.create_subscription(name, topic=topic, retry_policy=RetryPolicy(0, 0))
    acked = 0
    lock = threading.Lock()
    finished = threading.Event()

    def callback(message: Message) -> None:
        nonlocal acked
        message.ack()
        with lock:
            acked += 1
            if acked >= count:
                finished.set()

    subscriber = Subscriber({"bootstrap.servers": endpoints.bootstrap}, redis_url=endpoints.redis_url)
    before_threads = set(threading.enumerate())
    clock = GcClock()
    gc.callbacks.append(clock)
    process_start, services_start = time.process_time(), services_cpu(endpoints.redis_url)
    handle = subscriber.subscribe(name, callback, max_workers=workers,
                                  flow_control=FlowControl(max_messages=max(1000, workers * 4)),
                                  track_leases=track_leases)
    finished.wait(900)
    services = services_cpu(endpoints.redis_url)
    threads = [t for t in threading.enumerate() if t not in before_threads]
    roles: dict[str, list[threading.Thread]] = defaultdict(list)
    for thread in threads:
        roles[thread_role(thread.name)].append(thread)
    figures = {f"thread:{role}": thread_cpu(group) for role, group in roles.items()}
    figures["process"] = time.process_time() - process_start
    for service, seconds in services.items():
        figures[service] = seconds - services_start[service]
    gc.callbacks.remove(clock)
    for generation in range(3):
        figures[f"gc{generation}"] = clock.seconds[generation]
        figures[f"gc{generation}-runs"] = clock.runs[generation]
    native = handle.engine.native_fetch
    handle.cancel()
    return figures, native


def main() -> None:
    """Publish, take the per-message samples, run callback mode under probes, print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--consume-fetch", action="store_true", help="fetch through consume(), not natively")
    parser.add_argument("--no-leases", action="store_true", help="lease tracking switched off (track_leases=False)")
    args = parser.parse_args()
    if args.consume_fetch:
        os.environ["ORDERING_LAYER_NATIVE_FETCH"] = "0"
    count = args.messages
    with bench_stack() as endpoints:
        admin = Admin({"bootstrap.servers": endpoints.bootstrap}, redis_url=endpoints.redis_url)
        topic = workload_topic(endpoints, admin, "profile", count)
        sample, raw_cpu = fetched_sample(endpoints, topic, count)
        micro = micro_costs(sample)
        probe = Probe()
        for label, owner, name in PROBES:
            probe.wrap(label, owner, name)
        try:
            figures, native = callback_run(endpoints, admin, topic, count, args.workers,
                                           track_leases=not args.no_leases)
        finally:
            probe.undo()
    us = 1e6 / count
    print(f"messages {count}; leases {'off' if args.no_leases else 'on'}; "
          f"fetch: {'native' if native else 'consume()'}; raw consume loop (reference): "
          f"{raw_cpu * 1e6:.2f} us CPU per message")
    print("| step | CPU us per message |\n|---|---:|")
    for label, seconds in table(figures, dict(probe.cpu), micro, count, native):
        print(f"| {label} | {seconds * us:.2f} |")
    print(f"| Redis server (another process) | {figures['redis'] * us:.2f} |")
    print(f"| Kafka broker (another process) | {figures['kafka'] * us:.2f} |")
    machine = sum(figures[k] for k in ("process", "redis", "kafka"))
    cpus = os.cpu_count() or 1
    print(f"| machine total: process, Redis, broker ({cpus} cores: at most {cpus * count / machine:,.0f} msg/s) "
          f"| {machine * us:.2f} |")
    for generation in range(3):
        print(f"| garbage collector, generation {generation} ({figures[f'gc{generation}-runs']:.0f} runs; "
              f"part of the rows above) | {figures[f'gc{generation}'] * us:.2f} |")
    print("probe calls:", dict(probe.calls))


if __name__ == "__main__":
    main()
