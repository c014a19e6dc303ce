"""OrderedProducer.publish vs raw confluent_kafka.Producer.produce: same key, value and user headers.

100-byte messages over 10,000 ordering keys into a 6-partition topic, with 0 and with 3
attributes (the raw producer sends the same three as headers). Both producers are idempotent with
acks=all and linger.ms=5; the raw one gets a delivery callback too, since ``publish`` resolves a
future per message. Each side is timed from its first send until flush() returns: making and
closing the producers is outside the timing on both sides. One untimed raw run warms the broker up
first. Runs alternate (raw, layer, raw, layer, ...); the median of the per-round ratios is the
figure (the goal: >= 0.8 in both shapes), with the best of each side shown too.

``publish`` builds a message's ``PublishResult`` when its future's ``result()`` is first called;
after timing, the layer run asks every future for its result and prints what that took.

    .venv/bin/python bench/bench_publish.py [--messages 200000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka import Producer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import bench_stack, ratio_line
from ordering_layer import Admin, OrderedProducer

SETTINGS = {"enable.idempotence": True, "acks": "all", "linger.ms": 5}
ATTRIBUTES = {"event-type": "order-created", "schema": "v3", "source": "checkout"}


def run_raw(config: dict[str, Any], topic: str, payload: bytes, keys: list[bytes], count: int,
            attributes: dict[str, str]) -> float:
    """Raw produce of the same key, value and (as headers) attributes."""
    producer = Producer({**config, **SETTINGS, "partitioner": "murmur2_random"})
    delivered = 0
    headers: list[tuple[str, str | bytes | None]] | None = [
        (name, value.encode()) for name, value in attributes.items()] or None

    def on_delivery(err: object, msg: object) -> None:
        nonlocal delivered
        delivered += 1

    start = time.perf_counter()
    for n in range(count):
        while True:
            try:
                producer.produce(topic, payload, key=keys[n % len(keys)], on_delivery=on_delivery, headers=headers)
                break
            except BufferError:
                producer.poll(0.05)
        if n % 1000 == 0:
            producer.poll(0)
    producer.flush()
    elapsed = time.perf_counter() - start
    assert delivered == count
    return count / elapsed


def run_layer(config: dict[str, Any], topic: str, payload: bytes, keys: list[str], count: int,
              attributes: dict[str, str]) -> tuple[float, float]:
    """Messages per second, and microseconds per message to build the results afterwards."""
    given = attributes or None
    with OrderedProducer({**config, **SETTINGS}) as producer:
        start = time.perf_counter()
        futures = [producer.publish(topic, payload, ordering_key=keys[n % len(keys)], attributes=given)
                   for n in range(count)]
        producer.flush()
        elapsed = time.perf_counter() - start
    assert all(f.done() and f.exception() is None for f in futures)
    start = time.perf_counter()
    results = [f.result() for f in futures]
    resolving = time.perf_counter() - start
    assert len({r.message_id for r in results}) == count and all(r.offset >= 0 for r in results)
    return count / elapsed, resolving / count * 1e6


def main() -> None:
    """Run the comparison and print msgs/s and the ratios."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    payload = b"x" * 100
    text_keys = [f"key-{i}" for i in range(args.keys)]
    raw_keys = [k.encode() for k in text_keys]
    with bench_stack() as endpoints:
        admin = Admin(endpoints.kafka_config())

        def fresh_topic(prefix: str) -> str:
            name = f"bench-{prefix}-{uuid.uuid4().hex[:8]}"
            admin.create_topic(name, partitions=6)
            return name

        config = endpoints.kafka_config()
        run_raw(config, fresh_topic("warm-up"), payload, raw_keys, args.messages, {})
        for label, attributes in (("0 attributes", {}), ("3 attributes", ATTRIBUTES)):
            raw_best = layer_best = 0.0
            ratios: list[float] = []
            for round_ in range(args.rounds):
                raw = run_raw(config, fresh_topic("raw"), payload, raw_keys, args.messages, attributes)
                layer, resolving = run_layer(config, fresh_topic("layer"), payload, text_keys,
                                             args.messages, attributes)
                ratios.append(layer / raw)
                print(f"{label} round {round_ + 1}: raw {raw:,.0f} msg/s, layer {layer:,.0f} msg/s, ratio "
                      f"{layer / raw:.2f} (then result() on every future: {resolving:.2f} us each)", flush=True)
                raw_best, layer_best = max(raw_best, raw), max(layer_best, layer)
            print(ratio_line(f"publish {args.messages} x 100 B, {label} (best)", layer_best, raw_best))
            print(f"{label}: median of the per-round ratios: {statistics.median(ratios):.2f}", flush=True)


if __name__ == "__main__":
    main()
