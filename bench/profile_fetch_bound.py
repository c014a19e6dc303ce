"""The subscriber's fetch bounds and the garbage collector: bench (a) under variants of ``FlowGate``.

The fetch thread stops taking records when the flow-control gate closes (outstanding, bytes,
``max_buffered``) and while ``max_in_flight`` records it posted wait for the coordinator. Every
fetched record is a few live objects until it is released, and the collector's full passes walk
them all, so the bounds weigh on throughput. This script reads bench (a)'s workload (100 B, 10,000
keys, 6 partitions, callback mode, 16 workers, no-op callback) once per variant per round, rounds
interleaved, and times the collector's full passes with ``gc.callbacks``.

Variants: ``unbounded`` (no in-flight bound), ``default`` (the library's defaults) and
``buffered-5k`` (the default in-flight bound and ``max_buffered`` 5,000). The variants are set by
wrapping ``FlowGate``'s constructor: they are comparisons, not settings a user has.

    PYTHONPATH=. .venv/bin/python bench/profile_fetch_bound.py [--messages 200000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_subscribe import layer_consume, workload_topic
from bench.common import bench_stack
from ordering_layer import Admin
from ordering_layer.subscriber import flow

VARIANTS: dict[str, dict[str, int]] = {
    "unbounded": {"max_in_flight": 10**9},
    "default": {},
    "buffered-5k": {"max_buffered": 5_000},
}


class FullCollections:
    """Counts the collector's full passes and their wall time (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    constructor = flow.FlowGate.__init__
    chosen: dict[str, int] = {}

    def variant_gate(self: flow.FlowGate, limits: Any, **bounds: Any) -> None:
        constructor(self, limits, **{**bounds, **chosen})

    flow.FlowGate.__init__ = variant_gate  # type: ignore[method-assign]
    collections = FullCollections()
    gc.callbacks.append(collections)
    with bench_stack() as endpoints:
        admin = Admin(endpoints.kafka_config(), redis_url=endpoints.redis_url)
        topic = workload_topic(endpoints, admin, "bench-fetch-bound", args.messages)
        rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
        passes: dict[str, list[tuple[int, float]]] = {name: [] for name in VARIANTS}
        for round_ in range(args.rounds):
            for name, bounds in VARIANTS.items():
                chosen.clear()
                chosen.update(bounds)
                gc.collect()
                collections.count, collections.seconds = 0, 0.0
                rates[name].append(layer_consume(endpoints, admin, topic, args.messages, 16))
                passes[name].append((collections.count, collections.seconds))
            print(f"round {round_ + 1}: " + ", ".join(
                f"{name} {rates[name][-1]:,.0f} msg/s ({passes[name][-1][0]} full passes, "
                f"{passes[name][-1][1]:.2f} s)" for name in VARIANTS), flush=True)
        print(f"\n{args.messages:,} x 100 B, 10,000 keys, 6 partitions, callback mode; median of {args.rounds} rounds")
        for name in VARIANTS:
            print(f"{name:<12} {statistics.median(rates[name]):>10,.0f} msg/s   full passes "
                  f"{statistics.median(n for n, _ in passes[name]):.0f}, "
                  f"{statistics.median(s for _, s in passes[name]):.2f} s per run")


if __name__ == "__main__":
    main()
