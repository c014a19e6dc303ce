"""Where a message's time goes between its release and its settle, callback mode, bench (a) workload
(issue 11).

The rate of the subscriber is what flow control lets out over how long each message stays out: with
``max_messages`` outstanding at most, msg/s <= max_messages / (release -> settle). This script
times the stages of that stay for one message in eight (by offset), with ``perf_counter`` stamps
from wrappers around the engine's methods (the stamps are keyed by the delivery's token):

* release -> flush start: the release waits for the flush in flight to answer before its own flush
  takes its attempts (one flush in flight);
* flush start -> answer: the round trip of that flush, on the sending thread;
* answer -> hand-out: until the coordinator applies the answer and hands the batch out;
* hand-out -> callback: waiting in the callback pool's queue;
* callback -> ack: the user callback (a no-op here);
* ack -> settle: the ack waiting in the inbox until the coordinator's next step settles it.

    PYTHONPATH=. .venv/bin/python bench/profile_latency.py [--messages 200000] [--runs 2]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import threading
import time
import uuid
from collections import defaultdict
from concurrent.futures import Future
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_subscribe import workload_topic
from bench.common import bench_stack
from ordering_layer import Admin, Message, RetryPolicy, Subscriber
from ordering_layer.subscriber import dispatch, ownership, settlement
from ordering_layer.subscriber import message as message_module

STAMPS: dict[int, dict[str, Any]] = {}  # delivery token -> stage -> perf_counter
ANSWERED: dict[int, float] = {}  # id(flush future) -> when it was answered
STAGES = ("release", "flush start", "answer", "hand-out", "callback", "ack", "settle")
SAMPLED = 8  # one message in this many, by offset


def _stamp(message: Any, stage: str, at: float) -> None:
    stamps = STAMPS.get(message.token)
    if stamps is not None:
        stamps[stage] = at


def _instrument() -> None:
    release, hand_out = dispatch.Dispatcher.release, dispatch.Dispatcher.hand_out
    start, ack, acks = ownership.Ownership.start, message_module.Message.ack, settlement.Settlement.acks

    def timed_release(self: Any, now: float) -> Any:
        released = release(self, now)
        at = time.perf_counter()
        for _, batch in released:
            for message in batch:
                if message.record.offset % SAMPLED == 0:
                    STAMPS[message.token] = {"release": at}
        return released

    def timed_hand_out(self: Any, released: Any) -> None:
        at = time.perf_counter()
        for _, batch in released:
            for message in batch:
                _stamp(message, "hand-out", at)
        hand_out(self, released)

    def timed_start(self: Any, now: float) -> None:
        before = self._flights[-1] if self._flights else None
        start(self, now)
        if not self._flights or self._flights[-1] is before:
            return
        _, releases, sent = self._flights[-1]
        at = time.perf_counter()
        for released in releases:
            for _, batch in released:
                for message in batch:
                    _stamp(message, "flush start", at)
                    _stamp(message, "sent", sent)

        def answered(future: Future[None]) -> None:
            ANSWERED[id(future)] = time.perf_counter()

        sent.add_done_callback(answered)

    def timed_ack(self: Any) -> None:
        _stamp(self, "ack", time.perf_counter())
        ack(self)

    def timed_acks(self: Any, messages: list[Message], now: float) -> None:
        acks(self, messages, now)
        at = time.perf_counter()
        for message in messages:
            _stamp(message, "settle", at)

    dispatch.Dispatcher.release = timed_release  # type: ignore[method-assign]
    dispatch.Dispatcher.hand_out = timed_hand_out  # type: ignore[method-assign]
    ownership.Ownership.start = timed_start  # type: ignore[method-assign]
    message_module.Message.ack = timed_ack  # type: ignore[method-assign]
    settlement.Settlement.acks = timed_acks  # type: ignore[method-assign]


def one_run(bootstrap: str, redis_url: str, admin: Admin, topic: str, count: int) -> None:
    STAMPS.clear()
    ANSWERED.clear()
    name = f"latency-{uuid.uuid4().hex[:8]}"
    admin.create_subscription(name, topic=topic, retry_policy=RetryPolicy(0, 0))
    lock = threading.Lock()
    done = threading.Event()
    marks: list[float] = []
    acked = 0

    def callback(message: Message) -> None:
        nonlocal acked
        _stamp(message, "callback", time.perf_counter())
        message.ack()
        with lock:
            acked += 1
            if acked in (1, count):
                marks.append(time.perf_counter())
            if acked == count:
                done.set()

    subscriber = Subscriber({"bootstrap.servers": bootstrap}, redis_url=redis_url)
    handle = subscriber.subscribe(name, callback, max_workers=16)
    if not done.wait(600):
        raise RuntimeError(f"{acked} of {count} acked in 600 s")
    handle.cancel()
    spans: defaultdict[str, list[float]] = defaultdict(list)
    for stamps in STAMPS.values():
        sent = stamps.pop("sent", None)
        if sent is not None and id(sent) in ANSWERED:
            stamps["answer"] = ANSWERED[id(sent)]
        if not all(stage in stamps for stage in STAGES):
            continue
        for first, then in itertools.pairwise(STAGES):
            spans[f"{first} -> {then}"].append(stamps[then] - stamps[first])
        spans["release -> settle"].append(stamps["settle"] - stamps["release"])
    rate = count / (marks[-1] - marks[0])
    print(f"{rate:,.0f} msg/s; {len(spans['release -> settle'])} messages timed")
    print("| stage | mean ms | median ms |\n|---|---:|---:|")
    for label, values in spans.items():
        print(f"| {label} | {statistics.mean(values) * 1e3:.2f} | {statistics.median(values) * 1e3:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    _instrument()
    with bench_stack() as endpoints:
        admin = Admin({"bootstrap.servers": endpoints.bootstrap}, redis_url=endpoints.redis_url)
        topic = workload_topic(endpoints, admin, "latency", args.messages)
        for _ in range(args.runs):
            one_run(endpoints.bootstrap, endpoints.redis_url, admin, topic, args.messages)


if __name__ == "__main__":
    main()
