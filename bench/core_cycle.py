"""The compiled core's cycle alone, without Kafka or Redis (a development tool, issue 11).

Bench (a)'s shape on one partition: records of 10,000 keys are added 500 at a time, released into
a window of 1,000 outstanding deliveries (callback mode, a batch lease) and acked in runs in
release order, the ops taken as a flush takes them. Prints the best of N runs' process CPU time per
message (us). The wall-clock benches drift with this machine's pace; this one compares two builds
of the core within a few per cent:

    cd TREE && PYTHONPATH=. /work/main/.venv/bin/python /work/main/bench/core_cycle.py [RUNS]
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass
from typing import Any

from ordering_layer._core import LeaseTable, PartitionCore


@dataclass(slots=True)
class Rec:
    """A fetched record as the core reads it."""

    partition: int
    offset: int
    key: bytes
    size: int

class Msg:
    """What an ack carries to the lease table: the delivery's lease handle."""

    __slots__ = ("lease",)

    def __init__(self, lease: int) -> None:
        self.lease = lease


class Owned:
    """What the lease table reads of an owned partition."""

    __slots__ = ("core", "epoch")

    def __init__(self, core: PartitionCore[Any], epoch: int) -> None:
        self.core, self.epoch = core, epoch


def run(n: int = 300_000, keys: int = 10_000, window: int = 1000) -> float:
    """One cycle over ``n`` records; process CPU us per message."""
    core: PartitionCore[Rec] = PartitionCore(ordered=True)
    leases = LeaseTable(ack_deadline=10.0, max_lease_duration=3600.0)
    owned = {0: Owned(core, 1)}
    recs = [Rec(0, i, b"key-%d" % (i % keys), 100) for i in range(n)]
    gc.collect()
    gc.freeze()  # the records stand for fetched ones, which the collector does not track
    out: list[Msg] = []
    fed = done = 0
    t = time.process_time()
    while done < n:
        if fed < n and core.buffered < 2000:
            core.add(recs[fed:fed + 500])
            fed += 500
        _, _, _, _, _, handles = core.release_ready(
            0.0, window - leases.count, 1, 10**12, 10_000, pooled=True, leases=leases, partition=0, epoch=1)
        out.extend(Msg(h) for h in handles)
        if len(out) > 300 or (fed >= n and out):
            batch, out = out[:len(out) // 2 + 1], out[len(out) // 2 + 1:]
            done += leases.ack_run(batch, owned, 0.0)
        core.take_ops()
    return (time.process_time() - t) / n * 1e6


if __name__ == "__main__":
    print(f"{min(run() for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3)):.3f}")
