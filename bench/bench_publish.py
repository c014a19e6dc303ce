"""OrderedProducer.publish vs raw confluent_kafka.Producer.produce, same messages, same run (issue 2).

100-byte messages over 10,000 ordering keys into a 6-partition topic. Both producers are
idempotent with acks=all and linger.ms=5; the raw one gets a delivery callback too, since
``publish`` resolves a future per message. Runs alternate (raw, layer, raw, layer, ...) and the
best of each is reported, to damp noise on a 2-core machine.

    .venv/bin/python bench/bench_publish.py [--messages 200000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path

from confluent_kafka import Producer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import bench_stack, ratio_line
from ordering_layer import Admin, OrderedProducer

SETTINGS = {"enable.idempotence": True, "acks": "all", "linger.ms": 5}


def run_raw(bootstrap: str, topic: str, payload: bytes, keys: list[bytes], count: int) -> float:
    producer = Producer({"bootstrap.servers": bootstrap, **SETTINGS, "partitioner": "murmur2_random"})
    delivered = 0

    def on_delivery(err: object, msg: object) -> None:
        nonlocal delivered
        delivered += 1

    start = time.perf_counter()
    for n in range(count):
        while True:
            try:
                producer.produce(topic, payload, key=keys[n % len(keys)], on_delivery=on_delivery)
                break
            except BufferError:
                producer.poll(0.05)
        if n % 1000 == 0:
            producer.poll(0)
    producer.flush()
    elapsed = time.perf_counter() - start
    assert delivered == count
    return count / elapsed


def run_layer(bootstrap: str, topic: str, payload: bytes, keys: list[str], count: int) -> float:
    start = time.perf_counter()
    with OrderedProducer({"bootstrap.servers": bootstrap, **SETTINGS}) as producer:
        futures = [producer.publish(topic, payload, ordering_key=keys[n % len(keys)]) for n in range(count)]
        producer.flush()
    elapsed = time.perf_counter() - start
    assert all(f.done() and f.exception() is None for f in futures)
    return count / elapsed


def main() -> None:
    """Run the comparison and print msgs/s and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    payload = b"x" * 100
    text_keys = [f"key-{i}" for i in range(args.keys)]
    raw_keys = [k.encode() for k in text_keys]
    with bench_stack() as endpoints:
        admin = Admin({"bootstrap.servers": endpoints.bootstrap})
        raw_best = layer_best = 0.0
        for round_ in range(args.rounds):
            raw_topic, layer_topic = f"bench-raw-{uuid.uuid4().hex[:8]}", f"bench-layer-{uuid.uuid4().hex[:8]}"
            admin.create_topic(raw_topic, partitions=6)
            admin.create_topic(layer_topic, partitions=6)
            raw = run_raw(endpoints.bootstrap, raw_topic, payload, raw_keys, args.messages)
            layer = run_layer(endpoints.bootstrap, layer_topic, payload, text_keys, args.messages)
            print(f"round {round_ + 1}: raw {raw:,.0f} msg/s, layer {layer:,.0f} msg/s, ratio {layer / raw:.2f}")
            raw_best, layer_best = max(raw_best, raw), max(layer_best, layer)
        print(ratio_line(f"publish {args.messages} x 100 B, {args.keys} keys (best)", layer_best, raw_best))


if __name__ == "__main__":
    main()
