"""Push subscription benchmarks (issue 35), against a local endpoint that answers at once.

(a) Throughput: ``--messages`` 100-byte messages over 1,000 keys (6 partitions) pushed by the
    pusher (``Pusher``, ``--concurrency`` requests at most) vs a bare asyncio loop of the same HTTP
    client (aiohttp, the same connector limit and timeout) posting the same bodies (Pub/Sub's JSON
    push request of each message) with the same concurrency. Rates are the endpoint's: requests
    over the time from its first to its last arrival; beside them the CPU time of this process per
    message (every thread: the pusher's engine and loop, or the bare loop), which other load on the
    machine disturbs less than the rates. ``--rounds`` interleaved rounds (a new
    subscription of the same topic each round); the median of the per-round ratios. Goal >= 0.5x.
(b) Latency at ``--rate`` msg/s for ``--seconds`` over 1,000 keys: publish (``linger.ms=0``, from a
    publisher process of its own, as a publishing service would be) to the request's arrival at the
    endpoint, from the publish time each message carries in an attribute; then, alone too, the same
    path into a plain ``Subscriber`` callback, which is what the pusher adds to. A warm-up round
    (the broker's JIT compiler still at work on a fresh stack) is left out; then ``--rounds``
    rounds, pusher and plain subscriber interleaved; the medians of the per-round p50 and p99.
    Goal <= 5 ms at p50. With ``--stages``, p50 and p99 of each step of the pusher's path
    (``ordering_layer.push.stages``), from the subscriber's hand-out to the ack, the endpoint's
    arrival between, in the last round.

The endpoint is another process (``python -m tests.push_endpoint``), so that it takes no CPU time
from the process measured.

    .venv/bin/python -u bench/bench_push.py [--messages 20000] [--concurrency 100] [--rounds 3]
        [--rate 1000] [--seconds 10] [--scenarios ab] [--stages]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import bench_stack, quantile
from ordering_layer import Admin, Message, OrderedProducer, RetryPolicy, StartPosition, Subscriber
from ordering_layer.config import PushConfig
from ordering_layer.push import Pusher
from ordering_layer.push.request import wrapped
from ordering_layer.push.stages import ANSWERED, SENDING, SETTLED, WORKER, StageClock
from ordering_layer.stack import Endpoints
from tests.push_endpoint import free_port

KEYS = [f"key-{i}" for i in range(1000)]
PAYLOAD = b"x" * 100
PUBLISHED, ARRIVED = "published", "arrived"  # marks of the producer and of the endpoint
# (row, from mark, to mark) of the --stages table; the pusher's marks are ``StageClock``'s steps.
STAGES = (("publish -> a worker takes it", PUBLISHED, WORKER),
          ("worker -> request built, sending", WORKER, SENDING),
          ("sending -> arrived at the endpoint", SENDING, ARRIVED),
          ("arrived -> answer read", ARRIVED, ANSWERED),
          ("answer read -> acked", ANSWERED, SETTLED),
          ("publish -> arrived (total)", PUBLISHED, ARRIVED))


class Endpoint:
    """The endpoint process and its statistics."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/push"
        root = Path(__file__).resolve().parent.parent
        self._process = subprocess.Popen([sys.executable, "-m", "tests.push_endpoint", "--port", str(self.port)],
                                         cwd=root)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.stats()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stats(self, reset: bool = False, full: bool = False) -> dict[str, Any]:
        query = "&".join(name + "=1" for name, asked in (("reset", reset), ("full", full)) if asked)
        url = f"http://127.0.0.1:{self.port}/stats" + (f"?{query}" if query else "")
        with urllib.request.urlopen(url, timeout=10) as reply:
            stats: dict[str, Any] = json.loads(reply.read())
            return stats

    def wait_count(self, count: int, timeout: float = 300.0, full: bool = False) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if stats["count"] >= count:
                return self.stats(full=True) if full else stats
            if time.monotonic() > deadline:
                raise TimeoutError(f"{stats['count']} of {count} requests")
            time.sleep(0.25)  # seldom: the pusher's process polls while it runs, the bare loop's does not

    def close(self) -> None:
        self._process.terminate()
        self._process.wait(10)


@dataclass
class BodyMessage:
    """The fields of a message that its push body carries (``PushedMessage``)."""

    ordering_key: str
    message_id: str
    data: bytes = PAYLOAD
    attributes: dict[str, str] = field(default_factory=dict)
    enqueued_time: datetime = field(default_factory=lambda: datetime.now(UTC))
    delivery_attempt: int = 1


def rate(stats: dict[str, Any]) -> float:
    return float(stats["count"] / max(1e-9, stats["last"] - stats["first"]))


class Run(NamedTuple):
    """One side of a throughput round."""

    rate: float  # requests per second at the endpoint
    cpu: float  # CPU seconds of this process (every thread) per message


def pusher_run(endpoints: Endpoints, admin: Admin, topic: str, endpoint: Endpoint, count: int,
               concurrency: int) -> Run:
    """A pusher over the topic's ``count`` messages (a new subscription)."""
    name = f"bench-push-{uuid.uuid4().hex[:8]}"
    admin.create_subscription(name, topic=topic, retry_policy=RetryPolicy(0, 0),
                              push_config=PushConfig(endpoint.url, max_concurrent_requests=concurrency))
    endpoint.stats(reset=True)
    cpu = time.process_time()
    with Pusher(endpoints.kafka_config(), name, redis_url=endpoints.redis_url):
        stats = endpoint.wait_count(count)
    cpu = time.process_time() - cpu
    admin.delete_subscription(name)
    return Run(rate(stats), cpu / count)


def bare_run(endpoint: Endpoint, count: int, concurrency: int, subscription: str) -> Run:
    """A bare asyncio loop: aiohttp as the pusher sets it up, ``concurrency``
    workers posting the bodies of ``count`` messages as the pusher makes them."""
    bodies = [wrapped(BodyMessage(KEYS[n % len(KEYS)], str(n)), subscription) for n in range(count)]

    async def run() -> None:
        connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30),
                                         auto_decompress=False) as session:
            pending = iter(bodies)

            async def work() -> None:
                for body, headers in pending:
                    async with session.post(endpoint.url, data=body, headers=headers,
                                            allow_redirects=False) as response:
                        await response.read()

            await asyncio.gather(*(work() for _ in range(concurrency)))

    endpoint.stats(reset=True)
    cpu = time.process_time()
    asyncio.run(run())
    cpu = time.process_time() - cpu
    return Run(rate(endpoint.wait_count(count)), cpu / count)


def throughput(endpoints: Endpoints, admin: Admin, endpoint: Endpoint, count: int, concurrency: int,
               rounds: int) -> None:
    topic = f"bench-push-{uuid.uuid4().hex[:8]}"
    admin.create_topic(topic, partitions=6)
    with OrderedProducer(endpoints.kafka_config()) as producer:
        for n in range(count):
            producer.produce(topic, PAYLOAD, key=KEYS[n % len(KEYS)])
    ratios = []
    for number in range(1, rounds + 1):
        layer = pusher_run(endpoints, admin, topic, endpoint, count, concurrency)
        bare = bare_run(endpoint, count, concurrency, "bench-push")
        ratios.append(layer.rate / bare.rate)
        print(f"(a) round {number}: pusher {layer.rate:>9,.0f} msg/s   bare aiohttp loop {bare.rate:>9,.0f} msg/s   "
              f"ratio {layer.rate / bare.rate:4.2f}   CPU per message: pusher {layer.cpu * 1e6:4.0f} us, "
              f"bare loop {bare.cpu * 1e6:4.0f} us", flush=True)
    print(f"(a) {count:,} messages, 1,000 keys, concurrency {concurrency}: median ratio "
          f"{statistics.median(ratios):.2f} (goal >= 0.5)", flush=True)


def paced_publish(endpoints: Endpoints, topic: str, per_second: float, seconds: float) -> int:
    """Publish at ``per_second`` for ``seconds`` from a process of its own (``publish_here``), as a
    publishing service would: not on the interpreter lock of the process measured."""
    total = int(per_second * seconds)
    subprocess.run([sys.executable, __file__, "--publish", json.dumps([endpoints.kafka_config(), topic]),
                    "--rate", str(per_second), "--seconds", str(seconds)], check=True)
    return total


def publish_here(kafka: dict[str, Any], topic: str, per_second: float, seconds: float) -> None:
    """The publisher process: ``per_second`` messages a second over ``KEYS`` for ``seconds``, each
    carrying its publish time in ``sent``; returns once all are acknowledged by the broker."""
    total = int(per_second * seconds)
    with OrderedProducer({**kafka, "linger.ms": 0}) as producer:
        start = time.monotonic()
        for n in range(total):
            delay = start + n / per_second - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            producer.produce(topic, PAYLOAD, key=KEYS[n % len(KEYS)], headers=[("sent", repr(time.time()))])
            producer.poll(0)


def at(delays: list[float], q: float) -> float:
    """The ``q`` quantile of ``delays`` in ms."""
    return quantile(sorted(delays), q) * 1000


def percentiles(delays: list[float]) -> str:
    return (f"p50 {at(delays, 0.50):6.2f} ms   p90 {at(delays, 0.90):6.2f} ms   p99 {at(delays, 0.99):6.2f} ms   "
            f"max {max(delays) * 1000:7.2f} ms")


def stage_table(clock: StageClock, arrivals: dict[str, list[float]]) -> None:
    """Print p50 and p99 of each step of the messages the endpoint saw (``STAGES``)."""
    durations: dict[str, list[float]] = {row: [] for row, _, _ in STAGES}
    for message_id, (published, arrived) in arrivals.items():
        marks = {**clock.marks.get(message_id, {}), PUBLISHED: published, ARRIVED: arrived}
        for row, start, end in STAGES:
            if start in marks and end in marks:
                durations[row].append(marks[end] - marks[start])
    print(f"(b) the pusher's steps ({len(arrivals):,} messages):      p50        p99", flush=True)
    for row, values in durations.items():
        if values:
            p50, p99 = at(values, 0.5), at(values, 0.99)
            print(f"    {row:<36} {p50:7.2f} ms {p99:7.2f} ms", flush=True)


class Latencies(NamedTuple):
    """One phase of a (b) round: delays from the publish time and from the broker's append time."""

    published: list[float]
    appended: list[float]
    arrivals: dict[str, list[float]]  # the pusher's: {message id: [publish time, arrival time]}


def pusher_latency(endpoints: Endpoints, admin: Admin, endpoint: Endpoint, per_second: float, seconds: float,
                   concurrency: int, clock: StageClock | None) -> Latencies:
    """(b) at the pusher, alone on a fresh topic."""
    kafka = endpoints.kafka_config()
    topic = f"bench-push-lat-{uuid.uuid4().hex[:8]}"
    admin.create_topic(topic, partitions=6)
    name = f"bench-push-lat-{uuid.uuid4().hex[:8]}"
    admin.create_subscription(name, topic=topic, start=StartPosition.LATEST, retry_policy=RetryPolicy(0, 0),
                              push_config=PushConfig(endpoint.url, max_concurrent_requests=concurrency))
    with Pusher(kafka, name, redis_url=endpoints.redis_url, stages=clock):
        warm = paced_publish(endpoints, topic, per_second, 2.0)  # joined and warm
        endpoint.wait_count(warm, 60)
        endpoint.stats(reset=True)
        if clock is not None:
            clock.clear()
        total = paced_publish(endpoints, topic, per_second, seconds)
        stats = endpoint.wait_count(total, 60, full=True)
    return Latencies(stats["delays"], stats["appended"], stats["arrivals"])


def subscriber_latency(endpoints: Endpoints, admin: Admin, per_second: float, seconds: float) -> Latencies:
    """(b) at a plain ``Subscriber`` whose callback acks at once, alone on a fresh topic."""
    kafka = endpoints.kafka_config()
    topic = f"bench-sub-lat-{uuid.uuid4().hex[:8]}"
    admin.create_topic(topic, partitions=6)
    name = f"bench-sub-lat-{uuid.uuid4().hex[:8]}"
    admin.create_subscription(name, topic=topic, start=StartPosition.LATEST, retry_policy=RetryPolicy(0, 0))
    delays: list[float] = []
    appended: list[float] = []
    lock = threading.Lock()

    def callback(message: Message) -> None:
        arrived = time.time()
        message.ack()
        with lock:
            delays.append(arrived - float(message.attributes["sent"]))
            appended.append(arrived - message.enqueued_time.timestamp())

    subscriber = Subscriber(kafka, redis_url=endpoints.redis_url)
    with subscriber.subscribe(name, callback):
        warm = paced_publish(endpoints, topic, per_second, 2.0)
        deadline = time.monotonic() + 60
        while len(delays) < warm and time.monotonic() < deadline:
            time.sleep(0.05)
        with lock:
            delays.clear()
            appended.clear()
        total = paced_publish(endpoints, topic, per_second, seconds)
        deadline = time.monotonic() + 60
        while len(delays) < total and time.monotonic() < deadline:
            time.sleep(0.05)
    with lock:
        return Latencies(delays[:], appended[:], {})


def latency(endpoints: Endpoints, admin: Admin, endpoint: Endpoint, per_second: float, seconds: float,
            concurrency: int, rounds: int, stages: bool) -> None:
    """(b): a warm-up round left out, then ``rounds`` rounds of the pusher and a plain subscriber,
    each alone on a fresh topic; with ``stages`` the pusher's steps in the last round."""
    pusher_latency(endpoints, admin, endpoint, per_second, 3.0, concurrency, None)
    subscriber_latency(endpoints, admin, per_second, 3.0)
    rows: dict[str, list[tuple[float, float]]] = {"pusher": [], "pusher from append": [], "subscriber": [],
                                                  "subscriber from append": []}
    clock = StageClock() if stages else None
    arrivals: dict[str, list[float]] = {}
    for number in range(1, rounds + 1):
        pushed = pusher_latency(endpoints, admin, endpoint, per_second, seconds, concurrency,
                                clock if number == rounds else None)
        plain = subscriber_latency(endpoints, admin, per_second, seconds)
        arrivals = pushed.arrivals
        print(f"(b) round {number}: publish -> request (pusher) {percentiles(pushed.published)}", flush=True)
        print(f"(b) round {number}: publish -> callback (plain Subscriber) {percentiles(plain.published)}",
              flush=True)
        for row, delays in (("pusher", pushed.published), ("pusher from append", pushed.appended),
                            ("subscriber", plain.published), ("subscriber from append", plain.appended)):
            rows[row].append((at(delays, 0.5), at(delays, 0.99)))
    print(f"(b) {per_second * seconds:,.0f} messages a round at {per_second:,.0f} msg/s over 1,000 keys, "
          f"median of {rounds} rounds:", flush=True)
    labels = {"pusher": "publish -> request, pusher",
              "pusher from append": "broker append time (ms) -> request, pusher",
              "subscriber": "publish -> callback, plain Subscriber (what the pusher adds to)",
              "subscriber from append": "broker append time (ms) -> callback, plain Subscriber"}
    for row, figures in rows.items():
        p50 = statistics.median(f[0] for f in figures)
        p99 = statistics.median(f[1] for f in figures)
        goal = "   (goal p50 <= 5 ms)" if row == "pusher" else ""
        print(f"    {labels[row]:<66} p50 {p50:6.2f} ms   p99 {p99:7.2f} ms{goal}", flush=True)
    if clock is not None:
        stage_table(clock, arrivals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--scenarios", default="ab")
    parser.add_argument("--stages", action="store_true", help="(b): print the pusher's steps, p50 and p99 of each")
    parser.add_argument("--publish", help=argparse.SUPPRESS)  # JSON [kafka config, topic]: be (b)'s publisher
    args = parser.parse_args()
    if args.publish:
        kafka, topic = json.loads(args.publish)
        publish_here(kafka, topic, args.rate, args.seconds)
        return
    with bench_stack() as endpoints:
        admin = Admin(endpoints.kafka_config(), redis_url=endpoints.redis_url)
        endpoint = Endpoint()
        try:
            if "a" in args.scenarios:
                throughput(endpoints, admin, endpoint, args.messages, args.concurrency, args.rounds)
            if "b" in args.scenarios:
                latency(endpoints, admin, endpoint, args.rate, args.seconds, args.concurrency, args.rounds,
                        args.stages)
        finally:
            endpoint.close()


if __name__ == "__main__":
    main()
