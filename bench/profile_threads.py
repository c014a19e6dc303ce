"""CPU per message of each thread of the subscriber's process, callback or pull mode (a development
tool, issue 11).

Bench (a)'s workload (100 B, 10,000 keys, 6 partitions) read by one subscription: callback mode (16
workers, no-op callback and ack) or pull mode (``Subscriber.pull`` of 500, acked as a batch). Each
thread's CPU clock (``/proc/self/task/*/stat``, 10 ms ticks: use several hundred thousand messages)
is read at the first delivery and at the last ack; threads are grouped by name (the coordinator,
the fetch, the Redis sending thread, librdkafka's ``rdk:`` threads, the callback workers, the main
thread that pulls).

    PYTHONPATH=. .venv/bin/python bench/profile_threads.py [--messages 600000] [--pull]
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_subscribe import workload_topic
from bench.common import bench_stack
from ordering_layer import Admin, Message, RetryPolicy, Subscriber

_TICK = os.sysconf("SC_CLK_TCK")
_COORDINATOR = "ordering-layer-engine"
# The coordinator's calls into the components, measured with --phases (nested ones are included in
# their callers' figures too: the flush write in Ownership.start, the hand-out in Ownership.poll).
_PHASES = {
    "engine": ("Engine", ["_handle", "_wait_time"]),
    "settlement": ("Settlement", ["acks", "write_starts", "expire"]),
    "partitions": ("Partitions", ["take"]),
    "dispatch": ("Dispatcher", ["release", "hand_out"]),
    "ownership": ("Ownership", ["poll", "start"]),
    "state_writer": ("StateWriter", ["write", "finish"]),
    "inbox": ("Inbox", ["take", "wait"]),
    "flow": ("FlowGate", ["update"]),
}
_GROUPS = ("engine", "fetch", "redis", "-cb-", "MainThread", "rdk:")


def thread_cpu() -> dict[int, tuple[str, float]]:
    """Each thread of this process: its name and CPU seconds so far."""
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat", encoding="ascii") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as comm:
                name = comm.read().strip()
        except OSError:
            continue
        threads[int(tid)] = (names.get(int(tid), name), (int(fields[11]) + int(fields[12])) / _TICK)
    return threads


def group(name: str) -> str:
    """The group of a thread name (its first match in ``_GROUPS``, else the name)."""
    return next((prefix.strip("-:") or prefix for prefix in _GROUPS if prefix in name), name)


def wrap_phases(spent: dict[str, float]) -> None:
    """Wrap the coordinator's component calls to add their CPU time on the coordinator to ``spent``."""
    import importlib

    clock = time.thread_time
    for module_name, (class_name, methods) in _PHASES.items():
        cls = getattr(importlib.import_module(f"ordering_layer.subscriber.{module_name}"), class_name)
        for method in methods:
            original, label = getattr(cls, method), f"{class_name}.{method}"

            def timed(*args: object, _original: Any = original, _label: str = label, **kwargs: object) -> Any:
                if not threading.current_thread().name.startswith(_COORDINATOR):
                    return _original(*args, **kwargs)
                begun = clock()
                try:
                    return _original(*args, **kwargs)
                finally:
                    spent[_label] += clock() - begun

            setattr(cls, method, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=600_000)
    parser.add_argument("--pull", action="store_true", help="pull mode instead of callbacks")
    parser.add_argument("--phases", action="store_true", help="split the coordinator's CPU by component call")
    args = parser.parse_args()
    count = args.messages
    phases: dict[str, float] = collections.defaultdict(float)
    if args.phases:
        wrap_phases(phases)
    with bench_stack() as endpoints:
        admin = Admin(endpoints.kafka_config(), redis_url=endpoints.redis_url)
        topic = workload_topic(endpoints, admin, "threads", count)
        name = f"threads-{uuid.uuid4().hex[:8]}"
        admin.create_subscription(name, topic=topic, retry_policy=RetryPolicy(0, 0))
        subscriber = Subscriber(endpoints.kafka_config(), redis_url=endpoints.redis_url)
        start, before = 0.0, {}
        if args.pull:
            seen = 0
            while seen < count:
                messages = subscriber.pull(name, max_messages=500, timeout=1.0)
                if messages and not start:
                    start, before = time.perf_counter(), thread_cpu()
                    phases.clear()
                Subscriber.acknowledge(messages)
                seen += len(messages)
        else:
            acks, first, done = itertools.count(1), threading.Event(), threading.Event()

            def callback(message: Message) -> None:
                first.set()
                message.ack()
                if next(acks) >= count:
                    done.set()

            handle = subscriber.subscribe(name, callback, max_workers=16)
            first.wait(120)
            start, before = time.perf_counter(), thread_cpu()
            phases.clear()
            done.wait(600)
        elapsed, after = time.perf_counter() - start, thread_cpu()
        measured = dict(phases)
        if not args.pull:
            handle.cancel()
        subscriber.close()
    spent: dict[str, float] = collections.defaultdict(float)
    for tid, (thread, seconds) in after.items():
        spent[group(thread)] += seconds - before.get(tid, (thread, 0.0))[1]
    print(f"{'pull' if args.pull else 'callback'} mode: {count / elapsed:,.0f} msg/s over {elapsed:.2f} s")
    for thread, seconds in sorted(spent.items(), key=lambda item: -item[1]):
        print(f"  {thread:28s} {seconds / count * 1e6:6.2f} us/msg  ({seconds / elapsed:4.0%} of a core)")
    total = sum(spent.values())
    print(f"  {'process':28s} {total / count * 1e6:6.2f} us/msg  ({total / elapsed:4.0%} of a core)")
    if measured:
        print("the coordinator's calls (CPU on its thread):")
        for label, seconds in sorted(measured.items(), key=lambda item: -item[1]):
            print(f"  {label:28s} {seconds / count * 1e6:6.3f} us/msg")


if __name__ == "__main__":
    main()
