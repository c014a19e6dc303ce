"""Two source trees of the layer compared run by run on one topic (a development tool, issue 11).

This machine's pace drifts by up to half over an hour, so two versions of the subscriber are compared
only by alternated runs: one topic of bench (a)'s workload (100 B, 10,000 keys, 6 partitions) is
published once, then each tree in turn runs one callback subscription (16 workers unless told,
no-op callback and ack; ``--workers 0``: pull mode, pulls of 500 acked as a batch) in a process of
its own, with ``PYTHONPATH`` set to the tree, so each imports its own package and compiled core
(``ordering_layer/_core.abi3.so`` in the tree: build it there first). The rate is from the first
delivery to the last ack. Prints each pair and the median change.

    .venv/bin/python bench/ab_trees.py TREE_A TREE_B [--pairs 4] [--messages 300000] [--workers 16]
        [--max-messages 1000]

A stack named by ``ORDERING_LAYER_BOOTSTRAP``/``ORDERING_LAYER_REDIS_URL`` is used (``ordering-layer
stack env``), else a fresh local one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path


def one_run(bootstrap: str, redis_url: str, topic: str, count: int, workers: int = 16,
            max_messages: int = 1000) -> float:
    """One subscription of ``topic`` on the tree imported (``max_messages`` outstanding); returns msg/s."""
    from ordering_layer import Admin, FlowControl, Message, RetryPolicy, Subscriber

    flow = FlowControl(max_messages=max_messages)

    admin = Admin({"bootstrap.servers": bootstrap}, redis_url=redis_url)
    name = f"ab-{uuid.uuid4().hex[:8]}"
    admin.create_subscription(name, topic=topic, retry_policy=RetryPolicy(0, 0))
    lock = threading.Lock()
    done = threading.Event()
    marks: list[float] = []
    acked = 0

    def callback(message: Message) -> None:
        nonlocal acked
        message.ack()
        with lock:
            acked += 1
            if acked == 1 or acked == count:
                marks.append(time.perf_counter())
            if acked == count:
                done.set()

    subscriber = Subscriber({"bootstrap.servers": bootstrap}, redis_url=redis_url)
    if workers == 0:  # pull mode: pulls of 500, each acked as a batch
        start, seen = 0.0, 0
        while seen < count:
            messages = subscriber.pull(name, max_messages=500, timeout=1.0, flow_control=flow)
            start = start or (time.perf_counter() if messages else 0.0)
            Subscriber.acknowledge(messages)
            seen += len(messages)
        elapsed = time.perf_counter() - start
        subscriber.close()
        return count / elapsed
    handle = subscriber.subscribe(name, callback, max_workers=workers, flow_control=flow)
    if not done.wait(600):
        raise RuntimeError(f"{acked} of {count} acked in 600 s")
    handle.cancel()
    return count / (marks[-1] - marks[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="*", type=Path)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--messages", type=int, default=300_000)
    parser.add_argument("--workers", type=int, default=16,
                        help="callback workers (default 16); 0: pull mode (pulls of 500, acked as a batch)")
    parser.add_argument("--max-messages", type=int, default=1000, help="flow control's max_messages (default 1000)")
    parser.add_argument("--one", metavar="TOPIC", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        rate = one_run(os.environ["ORDERING_LAYER_BOOTSTRAP"], os.environ["ORDERING_LAYER_REDIS_URL"], args.one,
                       args.messages, args.workers, args.max_messages)
        print(f"{rate:.0f}")
        return
    if len(args.trees) != 2:
        parser.error("two trees")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.bench_subscribe import workload_topic
    from bench.common import bench_stack
    from ordering_layer import Admin

    with bench_stack() as endpoints:
        admin = Admin({"bootstrap.servers": endpoints.bootstrap}, redis_url=endpoints.redis_url)
        topic = workload_topic(endpoints, admin, "ab", args.messages)
        env = {**os.environ, "ORDERING_LAYER_BOOTSTRAP": endpoints.bootstrap,
               "ORDERING_LAYER_REDIS_URL": endpoints.redis_url}
        changes = []
        for pair in range(args.pairs):
            rates = []
            order = args.trees if pair % 2 == 0 else args.trees[::-1]
            for tree in order:
                out = subprocess.run(
                    [sys.executable, str(Path(__file__).resolve()), "--one", topic, "--messages", str(args.messages),
                     "--workers", str(args.workers), "--max-messages", str(args.max_messages)],
                    env={**env, "PYTHONPATH": str(tree.resolve())}, cwd=tree, check=True, capture_output=True,
                    text=True)
                rates.append(float(out.stdout.split()[-1]))
            a, b = rates if pair % 2 == 0 else rates[::-1]
            changes.append(b / a - 1)
            print(f"pair {pair + 1}: A {a:,.0f}  B {b:,.0f} msg/s  ({b / a - 1:+.1%})", flush=True)
        print(f"median change B vs A: {statistics.median(changes):+.1%}")


if __name__ == "__main__":
    main()
