"""OrderedProducer.publish vs raw confluent_kafka.Producer.produce, same messages, same run (issue 2).

100-byte messages over 10,000 ordering keys into a 6-partition topic. Both producers are
idempotent with acks=all and linger.ms=5; the raw one gets a delivery callback too, since
``publish`` resolves a future per message. Each side is timed from its first send until flush()
returns: making and closing the producers is outside the timing on both sides. One untimed raw
run warms the broker up first (on a fresh broker the first run is markedly slower, which would
favour whichever side goes second). Runs alternate (raw, layer, raw, layer, ...); the best of
each and the median of the per-round ratios are reported, to damp noise on a 2-core machine.

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

from confluent_kafka import Producer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import bench_stack, ratio_line
from ordering_layer import Admin, OrderedProducer

SETTINGS = {"enable.idempotence": True, "acks": "all", "linger.ms": 5}


def run_raw(bootstrap: str, topic: str, payload: bytes, keys: list[bytes], count: int,
            with_headers: bool = False) -> float:
    """Raw produce; ``with_headers`` adds three headers shaped like the layer's (a reference only:
    the goal compares with plain produce)."""
    producer = Producer({"bootstrap.servers": bootstrap, **SETTINGS, "partitioner": "murmur2_random"})
    delivered = 0
    prefix = uuid.uuid4().hex[:16].encode() + b"-"

    def on_delivery(err: object, msg: object) -> None:
        nonlocal delivered
        delivered += 1

    start = time.perf_counter()
    for n in range(count):
        while True:
            try:
                if with_headers:
                    producer.produce(topic, payload, key=keys[n % len(keys)], on_delivery=on_delivery,
                                     headers=[("ol-message-id", b"%s%x" % (prefix, n)),
                                              ("ol-partition-count", b"6"), ("ol-envelope", b"1")])
                else:
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


def run_layer(bootstrap: str, topic: str, payload: bytes, keys: list[str], count: int) -> tuple[float, float]:
    """Messages per second, and microseconds per message to build the results afterwards."""
    with OrderedProducer({"bootstrap.servers": bootstrap, **SETTINGS}) as producer:
        start = time.perf_counter()
        futures = [producer.publish(topic, payload, ordering_key=keys[n % len(keys)]) for n in range(count)]
        producer.flush()
        elapsed = time.perf_counter() - start
    assert all(f.done() and f.exception() is None for f in futures)
    start = time.perf_counter()
    results = [f.result() for f in futures]
    resolving = time.perf_counter() - start
    assert len({r.message_id for r in results}) == count and all(r.offset >= 0 for r in results)
    return count / elapsed, resolving / count * 1e6


def main() -> None:
    """Run the comparison and print msgs/s and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--header-reference", action="store_true",
                        help="also time raw produce with three layer-shaped headers per message")
    args = parser.parse_args()
    payload = b"x" * 100
    text_keys = [f"key-{i}" for i in range(args.keys)]
    raw_keys = [k.encode() for k in text_keys]
    with bench_stack() as endpoints:
        admin = Admin({"bootstrap.servers": endpoints.bootstrap})
        warm_up = f"bench-warm-up-{uuid.uuid4().hex[:8]}"
        admin.create_topic(warm_up, partitions=6)
        run_raw(endpoints.bootstrap, warm_up, payload, raw_keys, args.messages)
        raw_best = layer_best = 0.0
        ratios: list[float] = []
        for round_ in range(args.rounds):
            raw_topic, layer_topic = f"bench-raw-{uuid.uuid4().hex[:8]}", f"bench-layer-{uuid.uuid4().hex[:8]}"
            admin.create_topic(raw_topic, partitions=6)
            admin.create_topic(layer_topic, partitions=6)
            raw = run_raw(endpoints.bootstrap, raw_topic, payload, raw_keys, args.messages)
            layer, resolving = run_layer(endpoints.bootstrap, layer_topic, payload, text_keys, args.messages)
            ratios.append(layer / raw)
            print(f"round {round_ + 1}: raw {raw:,.0f} msg/s, layer {layer:,.0f} msg/s, ratio {layer / raw:.2f}"
                  f" (then result() on every future: {resolving:.2f} us each)", flush=True)
            if args.header_reference:
                headers_topic = f"bench-rawh-{uuid.uuid4().hex[:8]}"
                admin.create_topic(headers_topic, partitions=6)
                with_headers = run_raw(endpoints.bootstrap, headers_topic, payload, raw_keys, args.messages, True)
                print(f"         raw with 3 headers {with_headers:,.0f} msg/s; layer / that {layer / with_headers:.2f}",
                      flush=True)
            raw_best, layer_best = max(raw_best, raw), max(layer_best, layer)
        print(ratio_line(f"publish {args.messages} x 100 B, {args.keys} keys (best)", layer_best, raw_best))
        print(f"median of the per-round ratios: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
