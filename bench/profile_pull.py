"""Where pull mode's wall time goes: flush round trips, Redis's share, the coordinator's idle time
(a development tool, issue 11).

Bench (a)'s workload (100 B, 10,000 keys, 6 partitions) read by one pull-mode subscription: pulls of
500 acked as a batch, flow control's default 1,000 outstanding messages. Timed from the first pull
that returns messages to the last ack:

- the rate, and how long the pulling thread waited inside ``pull``;
- the flushes: how many, ops per flush, and each pipelined round trip (written to answer read,
  ``StateWriter.flush_seconds``);
- Redis's own time in ``apply.lua`` (``INFO commandstats``, reset at the first delivery): EVALSHA
  and the commands it ran;
- the coordinator's waits for events, split by what held it: the flow-control budget used up,
  records buffered or not, flushes in flight.

    PYTHONPATH=. .venv/bin/python bench/profile_pull.py [--messages 1000000] [--runs 2]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_subscribe import workload_topic
from bench.common import bench_stack
from ordering_layer import Admin, RetryPolicy, Subscriber
from ordering_layer.state import StateStore
from ordering_layer.subscriber.engine import Engine
from ordering_layer.subscriber.inbox import Inbox
from ordering_layer.subscriber.state_writer import Flush, StateWriter

_PULL = 500
_COMMANDS = ("evalsha", "hset", "hdel", "zadd", "zremrangebyscore")


class Watch:
    """The coordinator's waits by cause and the flushes begun, from the first delivery on."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.idle: dict[str, float] = collections.defaultdict(float)
        self.ops: list[int] = []

    def install(self) -> None:
        """Wrap ``Inbox.wait`` and ``StateWriter.begin`` (the coordinator's calls)."""
        wait, begin, watch = Inbox.wait, StateWriter.begin, self

        def timed_wait(inbox: Inbox[Any], size: int, timeout: float, readable: Any = None) -> bool:
            cause = watch.cause() if size == 1 else "gathering a batch of events"
            started = time.perf_counter()
            try:
                return wait(inbox, size, timeout, readable)
            finally:
                if cause is not None:
                    watch.idle[cause] += time.perf_counter() - started

        def counted_begin(writer: StateWriter, owned: Any) -> Flush:
            flush = begin(writer, owned)
            if watch.engine is not None:
                watch.ops.append(flush.count)
            return flush

        Inbox.wait = timed_wait  # type: ignore[method-assign,assignment]
        StateWriter.begin = counted_begin  # type: ignore[method-assign,assignment]

    def cause(self) -> str | None:
        """What holds the coordinator as it starts waiting for an event (None before the window)."""
        engine = self.engine
        if engine is None:
            return None
        full = engine._leases.count >= engine.flow_control.max_messages
        buffered = engine._owned.buffered() > 0
        return (f"budget {'used up' if full else 'free'}, {'records' if buffered else 'nothing'} buffered, "
                f"{engine._ownership.in_flight} flush(es) in flight")


def one_run(count: int, watch: Watch) -> None:
    """One subscription of a fresh topic of ``count`` messages, pulled to the end; prints the figures."""
    watch.engine, watch.ops = None, []
    watch.idle.clear()
    with bench_stack() as endpoints:
        admin = Admin(endpoints.kafka_config(), redis_url=endpoints.redis_url)
        topic = workload_topic(endpoints, admin, "pull-profile", count)
        name = f"pull-profile-{uuid.uuid4().hex[:8]}"
        admin.create_subscription(name, topic=topic, retry_policy=RetryPolicy(0, 0))
        redis = StateStore(endpoints.redis_url).client
        subscriber = Subscriber(endpoints.kafka_config(), redis_url=endpoints.redis_url)
        seen, start, blocked = 0, 0.0, 0.0
        while seen < count:
            began = time.perf_counter()
            messages = subscriber.pull(name, max_messages=_PULL, timeout=1.0)
            if start:
                blocked += time.perf_counter() - began
            elif messages:
                start = time.perf_counter()
                redis.config_resetstat()
                watch.engine = next(iter(subscriber._pull_engines.values()))
            Subscriber.acknowledge(messages)
            seen += len(messages)
        elapsed = time.perf_counter() - start
        assert watch.engine is not None
        trips = sorted(watch.engine._writer.flush_seconds)
        stats = redis.info("commandstats")
        subscriber.close()
    print(f"{count / elapsed:,.0f} msg/s over {elapsed:.2f} s; the pulling thread waited in pull "
          f"{blocked:.2f} s")
    if watch.ops:
        print(f"  flushes {len(watch.ops)}, ops per flush (median) {statistics.median(watch.ops):,.0f}")
    if trips:
        print(f"  round trip (written to answer read): median {statistics.median(trips) * 1e3:.2f} ms, "
              f"p90 {trips[int(len(trips) * 0.9)] * 1e3:.2f} ms")
    for command in _COMMANDS:
        entry = stats.get(f"cmdstat_{command}")
        if entry:
            print(f"  Redis {command.upper():17s} {entry['usec'] / 1e6:6.3f} s in {entry['calls']:,} calls "
                  f"({entry['usec_per_call']:.1f} us each)")
    print("  the coordinator waiting for an event, by what held it:")
    for cause, seconds in sorted(watch.idle.items(), key=lambda item: -item[1]):
        print(f"    {cause:62s} {seconds:6.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    watch = Watch()
    watch.install()
    for _ in range(args.runs):
        one_run(args.messages, watch)


if __name__ == "__main__":
    main()
