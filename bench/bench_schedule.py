"""Activation lag of scheduled messages (PUB-5): goal p99 <= 1 s after enqueue_at at 1,000 due/s.

Schedules ``rate * seconds`` messages (100 bytes, 1,000 ordering keys) whose enqueue times are
spread evenly at ``rate`` per second, starting ``lead`` seconds after the run starts (scheduling
must finish before the first is due; the run says so when it did not). ``schedulers`` in-process
``Scheduler`` instances activate them into a 6-partition topic. The lag of a message is the
broker's append time of the activated record (LogAppendTime) minus its enqueue_at; the target
topic is read back with a plain consumer, which also counts missing and duplicate ids.

    .venv/bin/python bench/bench_schedule.py [--rate 1000] [--seconds 30] [--schedulers 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import bench_stack
from ordering_layer import Admin, OrderedProducer, Scheduler
from ordering_layer.record import HEADER_MESSAGE_ID
from tests.kafka_helpers import read_topic


def percentile(values: list[float], fraction: float) -> float:
    """The ``fraction`` quantile of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered)) - 1))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=1000, help="Messages due per second.")
    parser.add_argument("--seconds", type=float, default=30.0, help="How long messages keep coming due.")
    parser.add_argument("--lead", type=float, default=None, help="Seconds until the first is due "
                        "(default: room to schedule them all at 500/s, at least 10).")
    parser.add_argument("--schedulers", type=int, default=1)
    parser.add_argument("--threads", type=int, default=32, help="Threads calling schedule().")
    args = parser.parse_args()
    count = int(args.rate * args.seconds)
    lead = args.lead if args.lead is not None else max(10.0, count / 500)
    with bench_stack() as endpoints:
        kafka = {"bootstrap.servers": endpoints.bootstrap}
        topic = f"bench-schedule-{uuid.uuid4().hex[:8]}"
        schedule_topic = f"bench-schedules-{uuid.uuid4().hex[:8]}"
        Admin(kafka).create_topic(topic, partitions=6)
        first_due = datetime.now(UTC) + timedelta(seconds=lead)
        due = [first_due + timedelta(seconds=n / args.rate) for n in range(count)]
        payload = b"x" * 100
        schedulers = [Scheduler(kafka, endpoints.redis_url, settings={"schedule_topic": schedule_topic},
                                name=f"bench-scheduler-{i}") for i in range(args.schedulers)]
        with OrderedProducer(kafka, redis_url=endpoints.redis_url,
                             settings={"scheduler": False, "schedule_topic": schedule_topic}) as producer:
            producer.schedule(topic, b"warm-up", enqueue_at=first_due - timedelta(seconds=lead))
            started = time.monotonic()
            with ThreadPoolExecutor(args.threads) as pool:
                ids = list(pool.map(lambda n: producer.schedule(topic, payload, f"key-{n % 1000}",
                                                                enqueue_at=due[n]), range(count)))
            took = time.monotonic() - started
            print(f"scheduled {count:,} in {took:.1f} s ({count / took:,.0f}/s)")
            late = datetime.now(UTC) > first_due
            for scheduler in schedulers:
                scheduler.start()
            try:
                records = read_topic(endpoints.bootstrap, topic, count + 1, timeout=args.seconds + lead + 120)
            finally:
                for scheduler in schedulers:
                    scheduler.stop()
        due_ms = {i: int(d.timestamp() * 1000) for i, d in zip(ids, due, strict=True)}
        seen: dict[str, int] = {}
        lags: list[float] = []
        for record in records:
            raw = dict(record.headers() or [])[HEADER_MESSAGE_ID]
            message_id = raw.decode() if isinstance(raw, bytes) else str(raw)
            seen[message_id] = seen.get(message_id, 0) + 1
            if message_id in due_ms and seen[message_id] == 1:
                lags.append((record.timestamp()[1] - due_ms[message_id]) / 1000)
        missing = len(set(ids) - set(seen))
        duplicates = sum(c - 1 for c in seen.values())
        print(f"rate {args.rate}/s for {args.seconds:.0f} s, {args.schedulers} scheduler(s): "
              f"{len(lags):,} activated, {missing} missing, {duplicates} duplicates")
        if lags:
            print(f"activation lag s: p50 {percentile(lags, 0.5):.3f}  p90 {percentile(lags, 0.9):.3f}  "
                  f"p99 {percentile(lags, 0.99):.3f}  max {max(lags):.3f}  mean {statistics.fmean(lags):.3f}  "
                  f"early {sum(1 for lag in lags if lag < 0)}")
        if late:
            print("warning: scheduling ended after the first message was due; raise --lead")
        return 0 if lags and not missing and percentile(lags, 0.99) <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
