"""How long a subscription takes to recover from a crashed subscriber (callback mode, DLQ-3).

A subscriber process (``tests/integration/subscriber_worker.py``: 16 callback workers, a handler of
``--delay-ms``, every delivery logged) works through a backlog; once it has acked ``--before``
messages it is stopped, and a second process takes over the same subscription. Two ways to stop:

* ``kill``: SIGKILL. Everything the dead process had handed out and not settled (up to the flow
  control's 1,000 messages, most of them waiting in its callback pool) is charged an attempt and
  comes back to the next owner as suspects, which go out one at a time per partition
  (``key_queue.Quarantine``) until each is settled;
* ``graceful``: SIGTERM: the process finishes what it handed out and commits; no suspects.

Printed per round and mode, from the second process's log: the messages redelivered to it (attempt
> 1), the seconds from its first delivery until the last of them was acked, and how long it took to
ack its first ``--window`` messages (its rate while recovering) against the same count after them.

    PYTHONPATH=. .venv/bin/python bench/bench_recovery.py [--messages 12000] [--keys 1000]
        [--partitions 6] [--delay-ms 20] [--before 2000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_subscribe import publish
from bench.common import bench_stack
from ordering_layer import Admin, DeadLetterPolicy, RetryPolicy
from ordering_layer.stack import Endpoints

ROOT = Path(__file__).resolve().parent.parent


class EventLog:
    """The workers' JSON-lines log, read as it grows: each poll parses only the lines added since."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.events: list[dict[str, Any]] = []
        self._ids: dict[tuple[str, str], set[str]] = {}  # (worker, action) -> message ids
        self._offset = 0

    def read(self) -> None:
        """Take the complete lines written since the last read."""
        if not self.path.exists():
            return
        with self.path.open("rb") as log:
            log.seek(self._offset)
            chunk = log.read()
        complete = chunk[:chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        for line in complete.splitlines():
            event = json.loads(line)
            self.events.append(event)
            self._ids.setdefault((event["sub"], event["action"]), set()).add(event["id"])

    def acked_ids(self, sub: str, *, sent: bool = False) -> set[str]:
        """Messages ``sub`` acked (confirmed); with ``sent`` also those it was acking (logged as
        ``release`` before the ack): a process killed between the ack's write and its confirmation
        settled them, and the next owner rightly never redelivers them."""
        self.read()
        acked = self._ids.get((sub, "ack"), set())
        return acked | self._ids.get((sub, "release"), set()) if sent else acked


def worker(endpoints: Endpoints, name: str, sub: str, log: Path, delay_ms: float,
           folder: Path) -> subprocess.Popen[bytes]:
    args = ["--bootstrap", endpoints.bootstrap, "--kafka-config", endpoints.kafka_config_file,
            "--redis-url", endpoints.redis_url, "--subscription", name, "--name", sub, "--log", str(log),
            "--delay-ms", str(delay_ms), "--workers", "16", "--session-ms", "2000", "--seconds", "600"]
    with (folder / f"{sub}.stderr").open("w") as stderr:
        return subprocess.Popen([sys.executable, "-m", "tests.integration.subscriber_worker", *args], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=stderr, env={**os.environ, "PYTHONPATH": str(ROOT)})


def wait_for(condition: Callable[[], bool], budget: float, what: str) -> None:
    deadline = time.monotonic() + budget
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.2)


def one_round(endpoints: Endpoints, admin: Admin, topic: str, messages: int, delay_ms: float, before: int,
              window: int, mode: str, folder: Path) -> dict[str, float]:
    name = f"bench-recovery-{uuid.uuid4().hex[:8]}"
    admin.create_subscription(name, topic=topic, ack_deadline=30.0,
                              retry_policy=RetryPolicy(0.1, 1.0),
                              dead_letter_policy=DeadLetterPolicy(f"{name}-dlq", max_delivery_attempts=5))
    log = folder / f"{name}.jsonl"
    tail = EventLog(log)
    first = worker(endpoints, name, "w0", log, delay_ms, folder)
    try:
        wait_for(lambda: len(tail.acked_ids("w0")) >= before, 300, f"{before} acks at w0")
        first.send_signal(signal.SIGKILL if mode == "kill" else signal.SIGTERM)
        first.wait(120)
    finally:
        if first.poll() is None:
            first.kill()
    settled_before = tail.acked_ids("w0", sent=True)
    second = worker(endpoints, name, "w1", log, delay_ms, folder)
    try:
        wait_for(lambda: len(settled_before | tail.acked_ids("w1")) >= messages, 600, "every message acked")
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(120)
    tail.read()
    mine = [e for e in tail.events if e["sub"] == "w1"]
    start = min(e["at"] for e in mine if e["action"] == "deliver")
    redelivered = {e["id"] for e in mine if e["action"] == "deliver" and e["attempt"] > 1}
    acks = sorted(e["at"] for e in mine if e["action"] == "ack")
    last_redelivered = max((e["at"] for e in mine if e["action"] == "ack" and e["id"] in redelivered), default=start)
    recovering = acks[window - 1] - start if len(acks) >= window else float("nan")
    after = acks[2 * window - 1] - acks[window - 1] if len(acks) >= 2 * window else float("nan")
    return {"redelivered": len(redelivered), "recovered_s": last_redelivered - start,
            "first_window_s": recovering, "next_window_s": after}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=12_000)
    parser.add_argument("--keys", type=int, default=1_000)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--before", type=int, default=2_000, help="acks of the first process before it stops")
    parser.add_argument("--window", type=int, default=2_000, help="acks per rate window of the second process")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with bench_stack() as endpoints, tempfile.TemporaryDirectory(prefix="ol-recovery-") as scratch:
        admin = Admin(endpoints.kafka_config(), redis_url=endpoints.redis_url)
        topic = f"bench-recovery-{uuid.uuid4().hex[:8]}"
        admin.create_topic(topic, partitions=args.partitions)
        publish(endpoints, topic, [f"key-{i}" for i in range(args.keys)], args.messages)
        results: dict[str, list[dict[str, float]]] = {"kill": [], "graceful": []}
        for round_ in range(args.rounds):
            for mode, runs in results.items():
                runs.append(one_round(endpoints, admin, topic, args.messages, args.delay_ms, args.before,
                                      args.window, mode, Path(scratch)))
                print(f"round {round_ + 1} {mode}: " + ", ".join(f"{k} {v:,.1f}" for k, v in runs[-1].items()),
                      flush=True)
        print(f"\n{args.messages:,} messages, {args.keys:,} keys, {args.partitions} partitions, "
              f"{args.delay_ms:g} ms handler, 16 workers; first process stopped after {args.before:,} acks; "
              f"medians of {args.rounds} rounds")
        print(f"{'stop':<10} {'redelivered':>12} {'recovered s':>12} {'first ' + str(args.window) + ' acks s':>18} "
              f"{'next ' + str(args.window) + ' acks s':>18}")
        for mode, runs in results.items():
            def median(field: str, runs: list[dict[str, float]] = runs) -> float:
                return statistics.median(run[field] for run in runs)
            print(f"{mode:<10} {median('redelivered'):>12,.0f} {median('recovered_s'):>12.1f} "
                  f"{median('first_window_s'):>18.1f} {median('next_window_s'):>18.1f}")


if __name__ == "__main__":
    main()
