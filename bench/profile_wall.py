"""Where the subscriber's wall time goes, callback mode, bench (a) workload (issue 11).

``profile_subscribe.py`` counts CPU per message; this script explains the rate: inside the measured
window (first delivery to last ack) it times, with ``perf_counter`` around the engine's methods,

* the coordinator waiting for events (``Inbox.wait``) and the fetch thread sleeping (its worker's
  pauses: the flow-control gate held, or its batches not yet taken);
* each Redis flush (``StateWriter.send``, or ``write`` and ``read`` when flushes are pipelined): wall
  time from its write to its last answer, the CPU spent writing and reading it, ops and bytes,
  against Redis's own EVALSHA time (``INFO commandstats``);
* the CPU of the Python threads and of the whole machine (``/proc/stat``) as a share of the wall;

and samples the engine every ~2 ms from a thread of its own: outstanding, buffered, the gate, a
flush in flight (sent and its answer not yet applied), ready keys.

    PYTHONPATH=. .venv/bin/python bench/profile_wall.py [--messages 200000] [--runs 2]
        [--max-messages 1000] [--no-redis]
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_subscribe import workload_topic
from bench.common import bench_stack
from bench.profile_subscribe import thread_cpu, thread_role
from ordering_layer import Admin, FlowControl, Message, RetryPolicy, Subscriber
from ordering_layer.stack import Endpoints
from ordering_layer.state import ApplyResult
from ordering_layer.state.client import redis_client
from ordering_layer.subscriber import engine as engine_module
from ordering_layer.subscriber import inbox, state_writer
from ordering_layer.subscriber.state_writer import Flush, StateWriter
from ordering_layer.worker import Worker

WALL: collections.defaultdict[str, float] = collections.defaultdict(float)
FLUSHES: collections.defaultdict[str, float] = collections.defaultdict(float)
ENGINES: list[Any] = []


def _timed(owner: Any, name: str, label: str) -> None:
    original = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            WALL[label] += time.perf_counter() - start

    setattr(owner, name, timed)


def _instrument(no_redis: bool) -> None:
    """Wrap the methods timed (see the module's text); engines are remembered for the sampler. With
    ``no_redis`` each flush is answered at once without a round trip (a ceiling, not a mode)."""
    _timed(inbox.Inbox, "wait", "coordinator waiting for events")
    send = _answer_at_once if no_redis else StateWriter.send
    if no_redis:  # flushes answered on the sending thread at once: one at a time is enough
        StateWriter.__init__ = _no_pipe(StateWriter.__init__)  # type: ignore[method-assign]

    def timed_send(self: StateWriter, flush: Flush) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        send(self, flush)
        FLUSHES["wall"] += time.perf_counter() - wall
        FLUSHES["cpu"] += time.thread_time() - cpu
        FLUSHES["count"] += 1
        FLUSHES["ops"] += sum(batch[3].count(";") for batch in flush.batches)
        FLUSHES["bytes"] += sum(len(batch[3]) for batch in flush.batches)

    state_writer.StateWriter.send = timed_send  # type: ignore[method-assign]
    write, read = StateWriter.write, StateWriter.read

    def timed_write(self: StateWriter, flush: Flush) -> None:
        cpu = time.thread_time()
        write(self, flush)
        FLUSHES["cpu"] += time.thread_time() - cpu

    def timed_read(self: StateWriter, flush: Flush) -> None:
        cpu, sent = time.thread_time(), flush.sent
        read(self, flush)
        FLUSHES["cpu"] += time.thread_time() - cpu
        if sent is not None:
            FLUSHES["wall"] += time.perf_counter() - flush.started
            FLUSHES["count"] += 1
            FLUSHES["ops"] += sum(batch[3].count(";") for batch in flush.batches)
            FLUSHES["bytes"] += sum(len(batch[3]) for batch in flush.batches)

    if not no_redis:
        state_writer.StateWriter.write = timed_write  # type: ignore[method-assign]
        state_writer.StateWriter.read = timed_read  # type: ignore[method-assign]
    run = Worker._run

    def timed_run(self: Worker) -> None:
        if not self._name.startswith("ordering-layer-fetch-"):
            run(self)
            return
        while not self._stop.is_set():
            pause = self._step()
            if pause > 0:
                start = time.perf_counter()
                self._stop.wait(pause)
                WALL["fetch thread sleeping"] += time.perf_counter() - start

    Worker._run = timed_run  # type: ignore[method-assign]
    init = engine_module.Engine.__init__

    def remembered(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        ENGINES.append(self)

    engine_module.Engine.__init__ = remembered  # type: ignore[method-assign]


def _answer_at_once(self: StateWriter, flush: Flush) -> None:
    flush.answers = [ApplyResult.APPLIED] * len(flush.batches)


def _no_pipe(init: Callable[..., None]) -> Callable[..., None]:
    def one_at_a_time(self: StateWriter, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **{**kwargs, "pipelined": False})

    return one_at_a_time


def machine_cpu() -> tuple[int, int]:
    """(all jiffies, idle jiffies) of the machine so far."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields), fields[3] + fields[4]


def sample(engine: Any, done: threading.Event) -> list[tuple[int, int, str, bool, int]]:
    """(outstanding, buffered, gate, flush in flight, ready keys) every ~2 ms until ``done``, under
    the engine's lock (the compiled cores are the coordinator's while it holds it)."""
    samples = []
    while not done.is_set():
        with engine._lock:
            samples.append((engine._leases.count, engine._owned.buffered(), engine._gate.state.value,
                            engine._ownership.in_flight > 0,
                            sum(len(state.core.ready_keys()) for state in engine._partitions.values())))
        time.sleep(0.002)
    return samples


def one_run(endpoints: Endpoints, admin: Admin, topic: str, count: int, max_messages: int,
            kafka: dict[str, Any]) -> None:
    name = f"wall-{uuid.uuid4().hex[:8]}"
    admin.create_subscription(name, topic=topic, retry_policy=RetryPolicy(0, 0))
    redis = redis_client(endpoints.redis_url)
    acked = 0
    lock = threading.Lock()
    started, finished = threading.Event(), threading.Event()
    marks: dict[str, Any] = {}
    before = set(threading.enumerate())

    def snapshot() -> dict[str, Any]:
        threads = [t for t in threading.enumerate() if t not in before and thread_role(t.name) != "other"]
        return {"at": time.perf_counter(), "machine": machine_cpu(), "python": thread_cpu(threads),
                "wall": dict(WALL), "flushes": dict(FLUSHES)}

    def callback(message: Message) -> None:
        nonlocal acked
        message.ack()
        with lock:
            acked += 1
            if acked == 1:
                redis.config_resetstat()
                marks["first"] = snapshot()
                started.set()
            if acked >= count:
                marks["last"] = snapshot()
                finished.set()

    subscriber = Subscriber({"bootstrap.servers": endpoints.bootstrap, **kafka}, redis_url=endpoints.redis_url)
    handle = subscriber.subscribe(name, callback, max_workers=16, flow_control=FlowControl(max_messages=max_messages))
    started.wait(120)
    samples = sample(ENGINES[-1], finished)
    finished.wait(600)
    evalsha = redis.info("commandstats").get("cmdstat_evalsha", {}).get("usec", 0) / 1e6
    handle.cancel()
    report(marks["first"], marks["last"], samples, evalsha, count)


def report(first: dict[str, Any], last: dict[str, Any], samples: list[tuple[int, int, str, bool, int]],
           evalsha: float, count: int) -> None:
    wall = last["at"] - first["at"]
    all_jiffies, idle = (b - a for a, b in zip(first["machine"], last["machine"], strict=True))
    print(f"{count / wall:,.0f} msg/s over {wall:.2f} s")
    print(f"  fetch, coordinator and callback threads' CPU: {(last['python'] - first['python']) / wall:.0%} of wall; "
          f"machine busy {1 - idle / all_jiffies:.0%}")
    for label in sorted(last["wall"]):
        seconds = last["wall"][label] - first["wall"].get(label, 0.0)
        print(f"  {label}: {seconds / wall:.0%} of wall")
    flushes = {k: last["flushes"].get(k, 0) - first["flushes"].get(k, 0) for k in last["flushes"]}
    n = max(1, flushes.get("count", 0))
    print(f"  flushes {int(flushes.get('count', 0))}: {flushes.get('ops', 0) / n:.0f} ops, "
          f"{flushes.get('bytes', 0) / n / 1024:.1f} KiB each; wall {flushes.get('wall', 0) / n * 1e3:.2f} ms, "
          f"CPU writing and reading {flushes.get('cpu', 0) / n * 1e3:.2f} ms, "
          f"Redis EVALSHA {evalsha / n * 1e3:.2f} ms; "
          f"sent {flushes.get('wall', 0) / wall:.0%} of wall")
    if not samples:
        return

    def share(test: Callable[[tuple[int, int, str, bool, int]], bool]) -> str:
        return f"{sum(1 for s in samples if test(s)) / len(samples):.0%}"

    size = len(samples)
    print(f"  samples {size}: outstanding mean {sum(s[0] for s in samples) // size}; "
          f"buffered mean {sum(s[1] for s in samples) // size}; gate held {share(lambda s: s[2] != 'open')}; "
          f"flush in flight {share(lambda s: s[3])}; ready keys mean {sum(s[4] for s in samples) // size}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--max-messages", type=int, default=1000)
    parser.add_argument("--no-redis", action="store_true",
                        help="answer each flush at once without Redis: the engine's ceiling (measurement only)")
    parser.add_argument("--fetch-queue-backoff-ms", type=int, default=None,
                        help="set librdkafka's fetch.queue.backoff.ms in the subscriber (the layer's default: 10)")
    args = parser.parse_args()
    kafka = {} if args.fetch_queue_backoff_ms is None else {"fetch.queue.backoff.ms": args.fetch_queue_backoff_ms}
    _instrument(args.no_redis)
    with bench_stack() as endpoints:
        admin = Admin({"bootstrap.servers": endpoints.bootstrap}, redis_url=endpoints.redis_url)
        topic = workload_topic(endpoints, admin, "wall", args.messages)
        for _ in range(args.runs):
            one_run(endpoints, admin, topic, args.messages, args.max_messages, kafka)


if __name__ == "__main__":
    main()
