"""Throughput with TLS and authentication on vs off, raw confluent-kafka and the layer (issue 13).

Two local stacks run side by side: a plain one and a secured one (Kafka SASL/SCRAM over TLS, Redis
ACL user and password over TLS, certificates from the stack's own CA). Each round publishes and
consumes the same workload on both, alternating which stack goes first:
- publish: raw ``Producer`` vs ``OrderedProducer.publish`` (100 B, 10,000 keys, 6 partitions);
- subscribe: raw consume loop vs the layer's callback mode (no-op handler that acks).
It prints every round and the medians of the per-round secured / plain ratios (informative: there
is no goal).

    .venv/bin/python -u bench/bench_tls.py [--messages 100000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_publish import run_layer, run_raw
from bench.bench_subscribe import layer_consume, raw_consume
from bench.common import bench_stack
from ordering_layer import Admin
from ordering_layer.stack import Endpoints

_KEYS = 10_000
_PAYLOAD = b"x" * 100


def measure(endpoints: Endpoints, admin: Admin, messages: int, workers: int) -> dict[str, float]:
    """One round on one stack: msg/s of raw and layer publish, raw and layer consume."""
    text_keys = [f"key-{i}" for i in range(_KEYS)]
    raw_keys = [k.encode() for k in text_keys]
    rates: dict[str, float] = {}
    raw_topic, layer_topic = (f"bench-tls-{kind}-{uuid.uuid4().hex[:8]}" for kind in ("raw", "layer"))
    for topic in (raw_topic, layer_topic):
        admin.create_topic(topic, partitions=6)
    config = endpoints.kafka_config()
    rates["raw publish"] = run_raw(config, raw_topic, _PAYLOAD, raw_keys, messages, {})
    rates["layer publish"] = run_layer(config, layer_topic, _PAYLOAD, text_keys, messages, {})[0]
    rates["raw consume"] = raw_consume(endpoints, layer_topic, messages)
    rates["layer consume"] = layer_consume(endpoints, admin, layer_topic, messages, workers)
    return rates


def main() -> None:
    """Run the interleaved rounds and print the ratios."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=16)
    args = parser.parse_args()
    with contextlib.ExitStack() as stacks:
        endpoints = {"plain": stacks.enter_context(bench_stack()),
                     "secured": stacks.enter_context(bench_stack(secure=True))}
        admins = {name: Admin(e.kafka_config(), redis_url=e.redis_url) for name, e in endpoints.items()}
        for name, stack in endpoints.items():
            # The first producer of a fresh broker waits for the transaction coordinator to load.
            warm_up = f"bench-tls-warm-up-{uuid.uuid4().hex[:8]}"
            admins[name].create_topic(warm_up, partitions=6)
            run_raw(stack.kafka_config(), warm_up, _PAYLOAD, [b"k"], 1000, {})
        runs: dict[str, list[dict[str, float]]] = {"plain": [], "secured": []}
        for round_ in range(args.rounds):
            order = ("plain", "secured") if round_ % 2 == 0 else ("secured", "plain")
            for name in order:
                runs[name].append(measure(endpoints[name], admins[name], args.messages, args.workers))
                print(f"round {round_ + 1} {name:<7}: " + ", ".join(
                    f"{step} {rate:,.0f}" for step, rate in runs[name][-1].items()) + " msg/s", flush=True)
        print(f"medians of {args.rounds} rounds, {args.messages} x 100 B, {_KEYS:,} keys, 6 partitions:")
        for step in runs["plain"][0]:
            plain = statistics.median(r[step] for r in runs["plain"])
            secured = statistics.median(r[step] for r in runs["secured"])
            ratio = statistics.median(s[step] / p[step] for s, p in zip(runs["secured"], runs["plain"], strict=True))
            print(f"{step:<14} plain {plain:>10,.0f} msg/s   secured {secured:>10,.0f} msg/s   "
                  f"secured / plain {ratio:.2f}")


if __name__ == "__main__":
    main()
