"""Per-message CPU cost of the engine's dispatch bookkeeping: ``PartitionState`` vs the compiled core.

Bench (a)'s workload without Kafka: synthetic fetched records (100 B, 10,000 keys written round-robin
as ``bench_subscribe.publish`` does, 6 partitions), fetched in batches of 500 in runs of one
partition, dispatched in callback mode (one message per key at a time) under the default flow
control (1,000 outstanding), every delivery acked in release order at the next step. Both paths run
the same operation sequence, step for step, and must release the same offsets with the same
attempts and pack the same Redis ops (checked after each round):

* Python: ``Partitions.take`` and ``Partitions.release`` over ``PartitionState`` (the library's own
  code), the attempt and lease ops as ``Dispatcher._admit`` builds them, ``PartitionState.ack`` with its
  settle op, and the packing of ``StateStore.apply_many``;
* compiled: ``partition_runs`` + ``PartitionCore.add``, the same round-robin release over
  ``PartitionCore.release_ready`` (ops written by the core), the acks gathered per partition into
  ``PartitionCore.ack``, and ``take_ops``.

CPU time of this thread (``thread_time``) per step, so it holds on a shared machine; rounds
interleave the two paths; the median of the rounds is printed per step, then a projection of the
subscriber's Python CPU per message with the engine's bookkeeping compiled (see ``projection``).

    PYTHONPATH=. .venv/bin/python bench/profile_core.py [--messages 200000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ordering_layer_core import PartitionCore, partition_runs

from ordering_layer.config import SubscriptionSettings
from ordering_layer.record import RecordMetadata
from ordering_layer.state.store import Op
from ordering_layer.subscriber.leases import Leases
from ordering_layer.subscriber.partition import Delivery, PartitionState, Record
from ordering_layer.subscriber.partitions import Partitions
from ordering_layer.subscriber.requests import Fetched

KEYS = 10_000
PARTITIONS = 6
PAYLOAD = 100
BATCH = 500
MAX_MESSAGES = 1000  # FlowControl's default
MAX_BYTES = 100 * 1024 * 1024
LEASE_MS = 1_800_000_000_000
STEPS = ("queueing", "release", "admit ops", "settle (ack + op)", "op packing", "commit points")

# The callback path's Python CPU per message (us), all threads (they share the GIL), from bench/RESULTS.md
# "Subscriber hot path: per-message CPU cost", runs (1) and (2) after the split: the Python threads
# together, the engine rows the core replaces (queueing, release, admit, Redis op encoding + flush),
# and the threads it leaves as they are (fetch, callbacks).
TABLE_RUNS = {
    "(1)": {"total": 12.9, "replaced": 1.10 + 1.48 + 0.83 + 0.78, "fetch + callbacks": 3.70 + 1.57},
    "(2)": {"total": 13.9, "replaced": 1.74 + 1.28 + 1.31 + 0.96, "fetch + callbacks": 3.66 + 1.31},
}
RAW_LOOP_MSG_S = (520_000, 730_000, 1_000_000)


def workload(count: int) -> list[list[Record]]:
    """Fetched batches of bench (a)'s records, each in runs of one partition as ``consume`` gives them."""
    meta = RecordMetadata(None, 1, None)
    keys = [f"key-{n}".encode() for n in range(KEYS)]
    payload = b"x" * PAYLOAD
    next_offset = [0] * PARTITIONS
    stream = []
    for n in range(count):
        key = keys[n % KEYS]
        partition = zlib.crc32(key) % PARTITIONS
        stream.append(Record(partition, next_offset[partition], key, payload, None, meta, PAYLOAD, 0))
        next_offset[partition] += 1
    return [sorted(stream[i:i + BATCH], key=lambda r: r.partition) for i in range(0, count, BATCH)]


class Clock:
    """Thread CPU seconds per step."""

    def __init__(self) -> None:
        self.cpu = dict.fromkeys(STEPS, 0.0)

    def run(self, step: str, work: Callable[..., Any], *args: Any) -> Any:
        start = time.thread_time()
        result = work(*args)
        self.cpu[step] += time.thread_time() - start
        return result


class PythonPath:
    """The engine's bookkeeping as the library does it now."""

    def __init__(self) -> None:
        self.partitions = Partitions(None, "bench", SubscriptionSettings(topic="bench"))
        for number in range(PARTITIONS):
            self.partitions.owned[number] = PartitionState(number, 1, ordered=True)
        self.generations = dict.fromkeys(range(PARTITIONS), 0)
        self.ops: dict[int, list[Op]] = {}
        self.leases = Leases(SubscriptionSettings(topic="bench"))

    def take(self, batch: list[Record]) -> None:
        self.partitions.take(Fetched(batch, self.generations))

    def release(self, now: float, budget: int, byte_budget: int) -> list[tuple[PartitionState, list[Delivery]]]:
        return self.partitions.release(now, budget, 1, byte_budget)

    def admit(self, released: list[tuple[PartitionState, list[Delivery]]]) -> None:
        for state, batch in released:  # Dispatcher._admit's ops in callback mode, into StateWriter.extend's lists
            ops: list[Op] = [("b", 0, LEASE_MS)]
            ops.extend([("q", d.record.offset, d.attempt) for d in batch])
            self.ops.setdefault(state.partition, []).extend(ops)

    def settle(self, acks: list[Delivery]) -> None:
        owned, writer = self.partitions.owned, self.ops
        for delivery in acks:  # Settlement.settle's state.ack and SETTLED op
            record = delivery.record
            owned[record.partition].ack(delivery.queue_key, record.offset, delivery.token)
            writer.setdefault(record.partition, []).append(("a", record.offset, 0))

    def pack(self) -> dict[int, str]:
        packed = {p: "".join([f"{kind},{offset},{value};" for kind, offset, value in ops])
                  for p, ops in self.ops.items() if ops}
        self.ops = {}
        return packed

    def commit_points(self) -> list[int | None]:
        return [state.tracker.watermark for state in self.partitions.owned.values()]

    def step(self, clock: Clock, batch: list[Record] | None, acks: list[Any],
             now: float) -> tuple[list[Any], list[tuple[int, int]], dict[int, str]]:
        clock.run("settle (ack + op)", self.settle, acks)
        if batch is not None:
            clock.run("queueing", self.take, batch)
        released = clock.run("release", self.release, now, MAX_MESSAGES, MAX_BYTES)
        clock.run("admit ops", self.admit, released)
        packed = clock.run("op packing", self.pack)
        clock.run("commit points", self.commit_points)
        delivered = [d for _, deliveries in released for d in deliveries]
        return delivered, [(d.record.offset, d.attempt) for d in delivered], packed

    def leases_cost(self, released: list[tuple[PartitionState, list[Delivery]]], now: float) -> float:
        """CPU seconds of ``Leases.admit`` (a batch per partition) and ``Leases.pop`` for a release."""
        start = time.thread_time()
        leases = self.leases
        for state, batch in released:
            leases.admit(state.partition, batch, now)
        for _, batch in released:
            for delivery in batch:
                leases.pop((delivery.record.partition, delivery.record.offset))
        return time.thread_time() - start


class CompiledPath:
    """The same bookkeeping over ``PartitionCore``: what an integrated engine would run."""

    def __init__(self) -> None:
        self.cores: dict[int, PartitionCore[Record]] = {p: PartitionCore(ordered=True) for p in range(PARTITIONS)}
        self._rotation = 0

    def take(self, batch: list[Record]) -> None:
        cores = self.cores
        for partition, start, stop in partition_runs(batch):
            cores[partition].add(batch, start, stop)

    def release(self, now: float, budget: int, byte_budget: int) -> list[tuple[list[Record], list[int], list[int]]]:
        """``Partitions.release``'s turns (a fair share each, starting one further each call, then
        the rest), each turn one call into a core."""
        cores = list(self.cores.values())
        self._rotation = start = (self._rotation + 1) % len(cores)
        cores = cores[start:] + cores[:start]
        for core in cores:
            core.wake(now)
        released: list[tuple[list[Record], list[int], list[int]]] = []
        share = max(1, -(-budget // len(cores)))
        for cap in (share, budget):
            for core in cores:
                if budget <= 0 or byte_budget <= 0:
                    return released
                records, tokens, attempts, size, _suspect = core.release_ready(
                    now, min(cap, budget), 1, byte_budget, LEASE_MS, pooled=True)
                if records:
                    byte_budget -= size
                    budget -= len(records)
                    released.append((records, tokens, attempts))
        return released

    def settle(self, acks: list[tuple[Record, int]]) -> None:
        pending: dict[int, tuple[list[int], list[int]]] = {}
        for record, token in acks:  # acks arrive mixed: gathered per partition, then one call each
            lists = pending.get(record.partition)
            if lists is None:
                lists = pending[record.partition] = ([], [])
            lists[0].append(record.offset)
            lists[1].append(token)
        cores = self.cores
        for partition, (offsets, tokens) in pending.items():
            cores[partition].ack(offsets, tokens)

    def pack(self) -> dict[int, str]:
        return {p: core.take_ops() for p, core in self.cores.items() if core.ops_count}

    def commit_points(self) -> list[int | None]:
        return [core.watermark for core in self.cores.values()]

    def step(self, clock: Clock, batch: list[Record] | None, acks: list[Any],
             now: float) -> tuple[list[Any], list[tuple[int, int]], dict[int, str]]:
        clock.run("settle (ack + op)", self.settle, acks)
        if batch is not None:
            clock.run("queueing", self.take, batch)
        released = clock.run("release", self.release, now, MAX_MESSAGES, MAX_BYTES)
        packed = clock.run("op packing", self.pack)
        clock.run("commit points", self.commit_points)
        delivered = [(r, t) for records, tokens, _ in released for r, t in zip(records, tokens, strict=True)]
        attempts = [a for _, _, batch_attempts in released for a in batch_attempts]
        return delivered, [(r.offset, a) for (r, _), a in zip(delivered, attempts, strict=True)], packed


def run(path: PythonPath | CompiledPath, batches: list[list[Record]]) -> tuple[dict[str, float], list[int]]:
    """Dispatch every record until all are acked (the acks of a step's release arrive before the
    next release); CPU seconds per step, and the trace of releases and ops to compare."""
    clock = Clock()
    trace: list[int] = []  # a digest per step: what a large trace would cost the steps in GC passes
    acks: list[Any] = []
    pending = iter(batches)
    acked = 0
    now = 0.0
    while True:
        now += 0.001
        batch = next(pending, None)
        if batch is None and not acks:
            break
        delivered, released, packed = path.step(clock, batch, acks, now)
        acked += len(acks)
        acks = delivered
        trace.append(hash((tuple(released), tuple(sorted(packed.items())))))
    assert acked == sum(len(b) for b in batches), "every record released and acked"
    return clock.cpu, trace


def rate(us: float) -> str:
    """The best rate at ``us`` of GIL-bound CPU per message, and its ratio to raw loops."""
    best = 1e6 / us
    ratios = ", ".join(f"{best / raw:.2f}x of {raw // 1000:,}k" for raw in RAW_LOOP_MSG_S)
    return f"{us:5.2f} us per message -> at most {best:>9,.0f} msg/s ({ratios})"


def projection(python: dict[str, float], compiled: dict[str, float], leases: float) -> list[str]:
    """The callback path's Python CPU per message with the engine's bookkeeping compiled.

    The Python threads share the GIL: their CPU per message bounds the rate on one core. Two
    estimates per run of the RESULTS table, around the truth:

    * conservative: the Python cost of the steps as measured alone here is taken out of the total
      and the compiled cost put in; inside the subscriber those steps cost more (GC passes over the
      fetch's objects, cache misses), so this under-counts the saving;
    * generous: the table's own rows for queueing, release, admit and Redis op encoding + flush go
      whole, the settle share measured here goes, and the compiled cost and ``Leases`` come in
      (the flush's pipeline round trip, kept in Python, is not counted);

    and the limit of any compiled engine bookkeeping: the fetch and callback threads alone.
    """
    py_total, compiled_total = sum(python.values()), sum(compiled.values())
    lines = []
    for run, rows in TABLE_RUNS.items():
        total = rows["total"]
        conservative = total - py_total + compiled_total
        generous = total - rows["replaced"] - python["settle (ack + op)"] + compiled_total + leases
        lines.append(f"run {run}, {total:.1f} us now:")
        lines.append(f"  conservative {rate(conservative)}")
        lines.append(f"  generous     {rate(generous)}")
        lines.append(f"  engine free  {rate(rows['fetch + callbacks'])}")
    return lines


def lease_cost(batches: list[list[Record]]) -> float:
    """CPU us per message of ``Leases.admit`` and ``Leases.pop`` over the workload's releases."""
    path = PythonPath()
    seconds, count = 0.0, 0
    for batch in batches:
        path.take(batch)
        released = path.release(0.0, MAX_MESSAGES, MAX_BYTES)
        seconds += path.leases_cost(released, 0.0)
        deliveries = [d for _, ds in released for d in ds]
        path.settle(deliveries)
        count += len(deliveries)
    return seconds / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    batches = workload(args.messages)
    # The fetched records of the whole run stay alive here (a subscriber holds at most its buffer):
    # out of the collector's generations, so that its passes do not scan them at every step.
    gc.collect()
    gc.freeze()
    figures: dict[str, dict[str, list[float]]] = {"python": {}, "compiled": {}}
    leases: list[float] = []
    for round_number in range(args.rounds):
        traces = {}
        for name, path in (("python", PythonPath()), ("compiled", CompiledPath())):
            cpu, traces[name] = run(path, batches)
            for step, seconds in cpu.items():
                figures[name].setdefault(step, []).append(seconds / args.messages * 1e6)

        if traces["python"] != traces["compiled"]:
            raise SystemExit(f"round {round_number + 1}: the compiled core released or packed differently")
        leases.append(lease_cost(batches))
        print(f"round {round_number + 1}: same releases, attempts and ops on both paths", file=sys.stderr)
    print(f"\nCPU us per message (thread_time, median of {args.rounds} interleaved rounds), "
          f"{args.messages:,} records, {KEYS:,} keys, {PARTITIONS} partitions, {PAYLOAD} B, batches of {BATCH}\n")
    print("| step | Python (PartitionState) | compiled core | ratio |\n|---|---:|---:|---:|")
    medians = {name: {step: statistics.median(figures[name][step]) for step in STEPS} for name in figures}
    python, compiled = medians["python"], medians["compiled"]
    for step in STEPS:
        ratio = f"{python[step] / compiled[step]:.1f}x" if compiled[step] else "-"
        print(f"| {step} | {python[step]:.3f} | {compiled[step]:.3f} | {ratio} |")
    py_total, compiled_total = sum(python.values()), sum(compiled.values())
    print(f"| **all steps** | **{py_total:.3f}** | **{compiled_total:.3f}** | **{py_total / compiled_total:.1f}x** |")
    lease = statistics.median(leases)
    print(f"| (`Leases.admit` + `pop`: Python in both, not replaced) | {lease:.3f} | | |")
    print("\nProjection, callback path, Python threads together (see `projection`):")
    print("\n".join(projection(python, compiled, lease)))


if __name__ == "__main__":
    main()
