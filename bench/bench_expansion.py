"""A partition expansion under a draining subscriber (SUB-8): how long until the new partitions are
consumed, how long a moved key's new messages wait once its old ones are acked, and what the
unmoved keys' throughput does while moved keys are held.

Each round: a topic of 4 partitions with ``--messages`` messages of 100 B over 1,000 keys, a
subscription (callback mode, no-op handler that acks); once ``--grow-at`` of them are acked the
topic grows to 8 (``Admin.add_partitions``) and a producer publishes ``--after`` more messages over
the same keys (half the keys move): the keys' new messages wait while their old ones drain.
Reported per round and as the median of ``--rounds`` rounds:

- growth -> new partitions: seconds from the growth until a new partition's records are fetched
  (its owner reports the moved keys it holds there; goal <= 15 s);
- moved key delay: per moved key, its first new message's delivery minus the later of its last
  old message's ack and the new message's append time (goal p99 <= 1 s);
- unmoved keys' throughput while moved keys wait, over their throughput in the same span before
  the growth (goal >= 0.9), and all keys' throughput before and after, for reference.

Where the hold's time goes (per round): the CPU seconds the move guard's thread spent reading the
old partitions (``OldPartitions._read``), asking Redis about
them (``unsettled``) and writing departure marks, and the publishing of ``--after`` in this
process, each over the hold's span: on two cores they take turns with the coordinator.

There is no raw confluent-kafka counterpart: a plain consumer holds nothing, and with librdkafka's
default ``topic.metadata.refresh.interval.ms`` (5 min) it may not read new partitions for minutes.

    .venv/bin/python bench/bench_expansion.py [--messages 1500000] [--after 20000] [--grow-at 0.1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import bench_stack
from ordering_layer import Admin, Message, OrderedProducer, RetryPolicy, Subscriber
from ordering_layer.kafka.partitioner import partition_for
from ordering_layer.stack import Endpoints
from ordering_layer.state.client import redis_client
from ordering_layer.state.counts import moves_key
from ordering_layer.subscriber.moves import MoveGuard
from ordering_layer.subscriber.old_partitions import OldPartitions

KEYS = [f"key-{i}" for i in range(1000)]
BEFORE, AFTER = 4, 8
MOVED = {key for key in KEYS if partition_for(key.encode(), BEFORE) != partition_for(key.encode(), AFTER)}


class Recorder:
    """Every delivery's (wall time, key, round, partition) and every old message's ack time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.deliveries: list[tuple[float, str, int, int, float]] = []  # at, key, round, partition, appended
        self.last_old_ack: dict[str, float] = {}
        self.acked = 0
        self.new_partitions_fetched = float("nan")

    def __call__(self, message: Message) -> None:
        at = time.time()
        round_ = message.data[0] - ord("0")
        key = message.ordering_key or ""
        appended = message.timestamp()[1] / 1000
        message.ack()
        done = time.time()
        with self.lock:
            self.deliveries.append((at, key, round_, message.partition(), appended))
            if round_ == 0:
                self.last_old_ack[key] = max(self.last_old_ack.get(key, 0.0), done)
            self.acked += 1


def watch_new_partitions(endpoints: Endpoints, subscription: str, recorder: Recorder) -> None:
    """Note when a new partition's records were first fetched: its owner reports the moved keys
    it holds (every key in a new partition moved) to Redis, as ``subscription describe`` shows."""
    client = redis_client(endpoints.redis_url)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(int(p) >= BEFORE and int(n) > 0 for p, n in client.hgetall(moves_key(subscription)).items()):
            recorder.new_partitions_fetched = time.time()
            return
        time.sleep(0.02)


def publish(endpoints: Endpoints, topic: str, count: int, round_: int) -> None:
    with OrderedProducer(endpoints.kafka_config()) as producer:
        payload = f"{round_}".encode() + b"x" * 99
        for n in range(count):
            producer.produce(topic, payload, key=KEYS[n % len(KEYS)])


class StepCosts:
    """CPU seconds (``time.thread_time``) of wrapped functions, summed per name, while installed."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)
        seconds = self.seconds

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[name] += time.thread_time() - start

        setattr(owner, attribute, timed)
        self._undo.append((owner, attribute, original))

    def __enter__(self) -> StepCosts:
        self.wrap(OldPartitions, "_read", "guard: reading old partitions")
        self.wrap(OldPartitions, "unsettled", "guard: asking Redis (unsettled)")
        self.wrap(MoveGuard, "_mark", "guard: departure marks")
        self.wrap(MoveGuard, "_check", "guard: whole check")
        return self

    def __exit__(self, *_: object) -> None:
        for owner, attribute, original in reversed(self._undo):
            setattr(owner, attribute, original)


def rate(deliveries: list[tuple[float, str, int, int, float]], start: float, end: float,
         keys: set[str] | None = None) -> float:
    if end <= start:
        return 0.0
    return sum(1 for at, key, *_ in deliveries if start <= at < end and (keys is None or key in keys)) / (end - start)


def one_round(endpoints: Endpoints, admin: Admin, messages: int, after: int, grow_at: float) -> dict[str, float]:
    topic, name = f"expansion-{uuid.uuid4().hex[:8]}", f"expansion-sub-{uuid.uuid4().hex[:8]}"
    admin.create_topic(topic, partitions=BEFORE)
    admin.create_subscription(name, topic=topic, retry_policy=RetryPolicy(0, 0))
    publish(endpoints, topic, messages, 0)
    recorder = Recorder()
    subscriber = Subscriber(endpoints.kafka_config(), redis_url=endpoints.redis_url)
    started = time.time()
    costs = StepCosts()
    with costs, subscriber.subscribe(name, recorder, max_workers=8):
        while recorder.acked < messages * grow_at:
            time.sleep(0.01)
        grown = time.time()
        admin.add_partitions(topic, AFTER)
        fetched = threading.Thread(target=watch_new_partitions, args=(endpoints, name, recorder), daemon=True)
        fetched.start()
        publish_cpu = time.thread_time()
        publish(endpoints, topic, after, 1)
        costs.seconds["publishing --after (this process)"] += time.thread_time() - publish_cpu
        deadline = time.monotonic() + 300
        while recorder.acked < messages + after and time.monotonic() < deadline:
            time.sleep(0.05)
        assert recorder.acked >= messages + after, f"only {recorder.acked} of {messages + after} acked"
    subscriber.close()
    deliveries = sorted(recorder.deliveries)
    fetched.join(60)
    first_new_partition = recorder.new_partitions_fetched
    first_new: dict[str, tuple[float, float]] = {}
    for at, key, round_, _, appended in deliveries:
        if round_ == 1 and key not in first_new:
            first_new[key] = (at, appended)
    delays = sorted(at - max(recorder.last_old_ack[key], appended) for key, (at, appended) in first_new.items()
                    if key in MOVED)
    held_until = max(at for key, (at, _) in first_new.items() if key in MOVED)
    span = held_until - grown
    unmoved = set(KEYS) - MOVED
    print("  CPU s over the hold span " + f"{span:.2f} s: " + ", ".join(
        f"{name} {seconds:.2f}" for name, seconds in sorted(costs.seconds.items())), flush=True)
    return {
        "growth_to_new_s": first_new_partition - grown,
        "delay_p50_s": statistics.median(delays),
        "delay_p99_s": delays[int(0.99 * (len(delays) - 1))],
        "delay_max_s": delays[-1],
        "hold_span_s": span,
        "unmoved_ratio": rate(deliveries, grown, held_until, unmoved)
        / max(rate(deliveries, max(started, grown - span), grown, unmoved), 1e-9),
        "all_before": rate(deliveries, started, grown),
        "all_after": rate(deliveries, grown, deliveries[-1][0]),
        "out_of_order_keys": float(sum(1 for key, (at, _) in first_new.items()
                                       if key in MOVED and at < recorder.last_old_ack[key] - 0.001)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=1_500_000)
    parser.add_argument("--after", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--grow-at", type=float, default=0.1, help="fraction of --messages acked at the growth")
    args = parser.parse_args()
    with bench_stack() as endpoints:
        admin = Admin(endpoints.kafka_config(), redis_url=endpoints.redis_url)
        results = []
        for number in range(args.rounds):
            result = one_round(endpoints, admin, args.messages, args.after, args.grow_at)
            results.append(result)
            print(f"round {number + 1}: " + "  ".join(f"{k} {v:.3f}" for k, v in result.items()), flush=True)
        print("median: " + "  ".join(f"{k} {statistics.median(r[k] for r in results):.3f}" for k in results[0]))
        by_goal = defaultdict(float, {k: statistics.median(r[k] for r in results) for k in results[0]})
        print(f"goals: growth -> new partitions {by_goal['growth_to_new_s']:.1f} s (<= 15), moved key delay p99 "
              f"{by_goal['delay_p99_s']:.3f} s (<= 1), unmoved keys during the hold {by_goal['unmoved_ratio']:.2f}x "
              f"(>= 0.9), keys out of order {by_goal['out_of_order_keys']:.0f}")


if __name__ == "__main__":
    main()
