"""Delivery latency, open loop, and hot keys: the layer against the raw confluent-kafka loop (issue 36).

``--scenario latency``: a paced plain confluent-kafka ``Producer`` (in a process of its own, so that it
takes no interpreter lock from the readers) sends 100-byte messages over 1,000 keys at a fixed rate;
each payload carries the message's *intended* send time (``time.monotonic_ns``, one clock for every
process of the machine), so a stall of the producer or of a reader shows as latency instead of
hiding itself (open loop). The latency of a message is from its intended send time to when the
reader has it: the raw ``Consumer.poll()`` loop; the layer's callback (``Subscriber.subscribe``,
no-op callback that acks); pull mode with a puller waiting in ``Subscriber.pull``; and
``OrderedConsumer.poll`` (explicit ack). Each reader gets a new topic (6 partitions) and is joined
before the paced stream begins; the first ``--warmup`` seconds of intended send times are left out.
Rounds are interleaved (every rate and mode once per round); printed: p50, p99, p99.9 and max per
mode and rate (medians of the rounds), and the layer minus the raw loop (medians of the per-round
differences), with the producer's own lag (actual - intended send time) for reference.

Then (``--stages``, on by default) one more pass per rate, instrumented: wrappers around the engine's
methods (installed in this process only, nothing in ``ordering_layer`` is changed) stamp one message
in ``SAMPLE`` (by offset) at each stage: produced, fetched (the fetch thread posts it), taken (the
coordinator takes it from its inbox), released, flush start (its attempt's flush is written to
Redis), handed out (the flush answered), delivered (in the callback / returned by the pull or poll);
the table gives each stage's p50/p99/mean. The same pass records the native fetch's calls (how long
each waited, how many records it brought) and the coordinator's inbox waits.

``--scenario redelivery``: the callback nacks each message's first delivery (``minimum_backoff=0``)
and acks its second; the time from the nack to the redelivery's callback (p50, p99; goal p99 <= 10 ms):
first over a backlog (``--redeliveries`` messages published beforehand: the redeliveries queue behind
the first deliveries, one flow-control window), then open loop, the paced stream at each of ``--rates``.

``--scenario hotkeys`` (issue 36's scenario (i)): one key x 20,000 messages, 1,000 keys uniform x
100,000 and 1,000 keys Zipf s = 1.1 x 100,000 (published beforehand); the raw consume loop, the
layer's no-op acking callback, pull mode and ``OrderedConsumer.consume`` over the same records,
rounds interleaved; msg/s and ratios. With ``--stages`` the one-key topic is read once more,
instrumented: the ack -> next delivery cycle of the key, stage by stage.

    .venv/bin/python bench/bench_latency.py [--scenario latency|hotkeys|redelivery|all] [--rates 200,2000,20000,100000]
        [--seconds 10] [--warmup 3] [--rounds 3] [--modes raw,callback,pull,consumer] [--no-stages]
        [--hot-messages 20000] [--keyed-messages 100000]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import multiprocessing
import random
import statistics
import struct
import sys
import threading
import time
import uuid
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, Producer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_subscribe import layer_consume, layer_ordered_consumer, layer_pull, raw_consume
from bench.common import bench_stack, quantile
from ordering_layer import Admin, Message, OrderedConsumer, OrderedProducer, RetryPolicy, Subscriber
from ordering_layer.stack import Endpoints
from ordering_layer.subscriber import dispatch, flushes, settlement
from ordering_layer.subscriber import engine as engine_module
from ordering_layer.subscriber import fetcher as fetcher_module
from ordering_layer.subscriber import flow as flow_module
from ordering_layer.subscriber import inbox as inbox_module
from ordering_layer.subscriber.client_config import FETCH_QUEUE_BACKOFF_MS
from ordering_layer.subscriber.requests import Fetched

PARTITIONS = 6
KEYS = 1000
PAYLOAD_BYTES = 100
MODES = ("raw", "callback", "pull", "consumer")
_HEAD = struct.Struct("<qq")  # intended send time (monotonic ns), sequence number (-1: a probe)
_PAD = b"x" * (PAYLOAD_BYTES - _HEAD.size)
_MS = 1e6  # ns per ms


def payload(intended_ns: int, seq: int) -> bytes:
    """A 100-byte message stamped with its intended send time and sequence number."""
    return _HEAD.pack(intended_ns, seq) + _PAD


# -- the paced producer (a process of its own) --------------------------------------------------------
def paced_producer(config: dict[str, Any], topic: str, rate: float, seconds: float, out: Connection) -> None:
    """Send ``rate`` x ``seconds`` messages, message n at t0 + n / rate (keys round robin over 1,000);
    sends back t0 and every message's actual send time (monotonic ns)."""
    producer = Producer(config)
    producer.list_topics(topic, timeout=10)
    keys = [f"key-{i}".encode() for i in range(KEYS)]
    total = int(rate * seconds)
    produced = array("q", bytes(8 * total))
    interval = 1e9 / rate
    t0 = time.monotonic_ns() + 20_000_000
    seq = 0
    while seq < total:
        now = time.monotonic_ns()
        due = min(total, int((now - t0) / interval) + 1) if now >= t0 else 0
        if seq >= due:
            producer.poll(0)
            time.sleep(max(0.0, (t0 + seq * interval - time.monotonic_ns()) / 1e9))
            continue
        while seq < due:
            try:
                producer.produce(topic, payload(t0 + int(seq * interval), seq), key=keys[seq % KEYS])
            except BufferError:
                producer.poll(0.001)
                continue
            produced[seq] = time.monotonic_ns()
            seq += 1
        producer.poll(0)
    producer.flush(30)
    out.send((t0, produced.tobytes()))
    out.close()


# -- what the readers received, and the stage stamps ------------------------------------------------------
SAMPLE = 8  # stage stamps for one message in this many, by offset
STAMPS: dict[tuple[int, int], dict[str, int]] = {}  # (partition, offset) -> stage -> monotonic ns
FETCH_CALLS: list[tuple[float, int, int]] = []  # native fetch calls: (timeout s, waited ns, records)
INBOX_WAITS: list[tuple[int, float, int]] = []  # coordinator inbox waits: (size, timeout s, waited ns)
_STAMPING = [False]


def _stamp(partition: int, offset: int, stage: str, now: int) -> None:
    if offset % SAMPLE == 0:
        STAMPS.setdefault((partition, offset), {})[stage] = now


class Recorder:
    """Receipts of one reader: (intended ns, seq, received ns) of each data message; the partitions
    probes came from."""

    def __init__(self) -> None:
        self.received: list[tuple[int, int, int]] = []
        self.probed: set[int] = set()

    def got(self, value: bytes, partition: int, offset: int) -> None:
        now = time.monotonic_ns()
        intended, seq = _HEAD.unpack_from(value)
        if seq < 0:
            self.probed.add(partition)
            return
        self.received.append((intended, seq, now))
        if _STAMPING[0] and offset % SAMPLE == 0:
            stages = STAMPS.setdefault((partition, offset), {})
            stages["delivered"], stages["intended"], stages["seq"] = now, intended, seq


# -- the readers: each started on a topic, stopped by the returned function ----------------------------------
def start_raw(endpoints: Endpoints, admin: Admin, topic: str, recorder: Recorder) -> Callable[[], None]:
    """The raw loop: ``Consumer.poll()`` one message at a time (auto commit), the layer's fetch backoff."""
    stop = threading.Event()

    def loop() -> None:
        consumer = Consumer({**endpoints.kafka_config(), "group.id": f"raw-{uuid.uuid4().hex}",
                             "auto.offset.reset": "earliest", "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS})
        consumer.subscribe([topic])
        got = recorder.got
        while not stop.is_set():
            msg = consumer.poll(0.1)
            if msg is not None and msg.error() is None:
                got(msg.value(), msg.partition(), msg.offset())
        consumer.close()

    thread = threading.Thread(target=loop, name="bench-raw", daemon=True)
    thread.start()

    def stopper() -> None:
        stop.set()
        thread.join()

    return stopper


def start_callback(endpoints: Endpoints, admin: Admin, topic: str, recorder: Recorder) -> Callable[[], None]:
    """The layer in callback mode, defaults (10 workers, default flow control): a no-op callback that acks."""
    name = f"lat-cb-{uuid.uuid4().hex[:8]}"
    admin.create_subscription(name, topic=topic)
    got = recorder.got

    def callback(message: Message) -> None:
        record = message.record
        got(message.data, record.partition, record.offset)
        if _STAMPING[0]:
            _stamp(record.partition, record.offset, "acked", time.monotonic_ns())
        message.ack()

    handle = Subscriber(endpoints.kafka_config(), redis_url=endpoints.redis_url).subscribe(name, callback)

    def stopper() -> None:
        handle.cancel()

    return stopper


def start_pull(endpoints: Endpoints, admin: Admin, topic: str, recorder: Recorder) -> Callable[[], None]:
    """Pull mode: one thread waiting in ``Subscriber.pull`` (up to 500), acking each batch at once."""
    name = f"lat-pull-{uuid.uuid4().hex[:8]}"
    admin.create_subscription(name, topic=topic)
    subscriber = Subscriber(endpoints.kafka_config(), redis_url=endpoints.redis_url)
    stop = threading.Event()

    def loop() -> None:
        got = recorder.got
        while not stop.is_set():
            messages = subscriber.pull(name, max_messages=500, timeout=0.5)
            for message in messages:
                got(message.data, message.record.partition, message.record.offset)
            subscriber.acknowledge(messages)

    thread = threading.Thread(target=loop, name="bench-pull", daemon=True)
    thread.start()

    def stopper() -> None:
        stop.set()
        thread.join()
        subscriber.close()

    return stopper


def start_consumer(endpoints: Endpoints, admin: Admin, topic: str, recorder: Recorder) -> Callable[[], None]:
    """``OrderedConsumer.poll()`` one message at a time, each acked (``enable.auto.commit`` off)."""
    stop = threading.Event()

    def loop() -> None:
        consumer = OrderedConsumer({**endpoints.kafka_config(), "group.id": f"lat-oc-{uuid.uuid4().hex[:8]}",
                                    "auto.offset.reset": "earliest", "enable.auto.commit": False},
                                   redis_url=endpoints.redis_url)
        consumer.subscribe([topic])
        got = recorder.got
        while not stop.is_set():
            message = consumer.poll(0.5)
            if message is not None:
                got(message.data, message.record.partition, message.record.offset)
                message.ack()
        consumer.close()

    thread = threading.Thread(target=loop, name="bench-oc", daemon=True)
    thread.start()

    def stopper() -> None:
        stop.set()
        thread.join()

    return stopper


NACKED_AT: dict[int, int] = {}  # the nacking reader: seq -> when its first delivery was nacked (ns)
REDELIVERED: list[tuple[int, float]] = []  # the nacking reader: (intended ns, nack -> redelivery ms)


def start_nacking(endpoints: Endpoints, admin: Admin, topic: str, recorder: Recorder) -> Callable[[], None]:
    """The layer in callback mode (defaults, ``minimum_backoff=0``): each message's first delivery is
    nacked, its second acked; the reader has a message at its second delivery (``REDELIVERED``: the
    time from the nack to the redelivery's callback)."""
    name = f"lat-nack-{uuid.uuid4().hex[:8]}"
    admin.create_subscription(name, topic=topic, retry_policy=RetryPolicy(0, 0))
    got = recorder.got

    def callback(message: Message) -> None:
        now = time.monotonic_ns()
        data, record = message.data, message.record
        intended, seq = _HEAD.unpack_from(data)
        if seq >= 0 and message.delivery_attempt == 1:
            NACKED_AT[seq] = now
            message.nack()
            return
        if seq >= 0:
            REDELIVERED.append((intended, (now - NACKED_AT[seq]) / _MS))
        got(data, record.partition, record.offset)
        message.ack()

    handle = Subscriber(endpoints.kafka_config(), redis_url=endpoints.redis_url).subscribe(name, callback)

    def stopper() -> None:
        handle.cancel()

    return stopper


READERS: dict[str, Callable[[Endpoints, Admin, str, Recorder], Callable[[], None]]] = {
    "raw": start_raw, "callback": start_callback, "pull": start_pull, "consumer": start_consumer,
    "nacking": start_nacking}


# -- one measurement ------------------------------------------------------------------------------------------
@dataclass
class Run:
    """Latencies (ms) of the measured window of one reader at one rate."""

    mode: str
    rate: float
    latencies: list[float]
    missing: int
    producer_lag: list[float]  # actual - intended send time (ms), measured window
    stamps: dict[tuple[int, int], dict[str, int]] = field(default_factory=dict)

    def pct(self, q: float) -> float:
        """The ``q`` quantile (0..1) of the latencies; max for 1."""
        values = self.latencies
        if not values:
            return float("nan")
        return values[min(len(values) - 1, int(q * len(values)))]


def probe(endpoints: Endpoints, topic: str, recorder: Recorder, timeout: float = 90.0) -> None:
    """Send probes (over 60 keys) until the reader has had one from every partition: it is joined."""
    producer = Producer({**endpoints.kafka_config(), "linger.ms": 0})
    deadline = time.monotonic() + timeout
    while len(recorder.probed) < PARTITIONS:
        if time.monotonic() > deadline:
            raise TimeoutError(f"reader not joined after {timeout:.0f} s (probes from {sorted(recorder.probed)})")
        for i in range(60):
            producer.produce(topic, payload(0, -1), key=f"key-{i}".encode())
        producer.flush(10)
        time.sleep(0.2)


def measure(endpoints: Endpoints, admin: Admin, mode: str, rate: float, seconds: float, warmup: float,
            linger_ms: float) -> Run:
    """One reader on a new topic, a paced stream of ``warmup + seconds``; the measured window's figures."""
    topic = f"lat-{mode}-{int(rate)}-{uuid.uuid4().hex[:8]}"
    admin.create_topic(topic, partitions=PARTITIONS)
    recorder = Recorder()
    stop = READERS[mode](endpoints, admin, topic, recorder)
    try:
        probe(endpoints, topic, recorder)
        time.sleep(0.5)  # the probes' acks and commits settle
        STAMPS.clear()
        FETCH_CALLS.clear()
        INBOX_WAITS.clear()
        context = multiprocessing.get_context("spawn")
        receiver, sender = context.Pipe(duplex=False)
        config = {**endpoints.kafka_config(), "linger.ms": linger_ms}
        process = context.Process(target=paced_producer, args=(config, topic, rate, warmup + seconds, sender))
        process.start()
        t0, produced_bytes = receiver.recv()
        process.join()
        produced = array("q")
        produced.frombytes(produced_bytes)
        total = len(produced)
        deadline = time.monotonic() + max(15.0, seconds)
        while len(recorder.received) < total and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop()
    interval = 1e9 / rate
    first = int(warmup * rate)  # the first message of the measured window
    cutoff = t0 + int(first * interval)
    seen: set[int] = set()
    latencies = []
    for intended, seq, got in recorder.received:
        if seq not in seen:
            seen.add(seq)
            if intended >= cutoff:
                latencies.append((got - intended) / _MS)
    # A message not received by the end of the drain counts with its wait so far (a lower bound).
    ended = time.monotonic_ns()
    latencies.extend((ended - (t0 + int(seq * interval))) / _MS for seq in range(first, total) if seq not in seen)
    latencies.sort()
    lag = sorted((produced[seq] - (t0 + int(seq * interval))) / _MS for seq in range(first, total))
    missing = sum(1 for seq in range(first, total) if seq not in seen)
    stamps: dict[tuple[int, int], dict[str, int]] = {}
    if _STAMPING[0]:  # the stamped deliveries of the measured window, with their actual send time
        for key, stages in STAMPS.items():
            if "delivered" in stages and stages["intended"] >= cutoff:
                stages["produced"] = produced[stages["seq"]]
                stamps[key] = stages
    return Run(mode, rate, latencies, missing, lag, stamps)


# -- instrumentation (this process only) --------------------------------------------------------------------
class _TimedFetch:
    """A ``NativeFetch`` whose ``fetch`` calls are timed."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def fetch(self, max_records: int, timeout: float, caps: dict[int, int] | None = None) -> Any:
        start = time.monotonic_ns()
        result = self._inner.fetch(max_records, timeout, caps)
        FETCH_CALLS.append((timeout, time.monotonic_ns() - start, len(result[0])))
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _stamp_released(released: Any, stage: str) -> None:
    now = time.monotonic_ns()
    for _, batch in released:
        for message in batch:
            record = message.record
            _stamp(record.partition, record.offset, stage, now)


@contextlib.contextmanager
def instrumented() -> Iterator[None]:
    """Stage stamps from wrappers around the engine's methods, for engines made inside."""
    patches: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, name)
        patches.append((owner, name, original))
        setattr(owner, name, make(original))

    def open_native_fetch(original: Any) -> Any:
        def opened(*args: Any, **kwargs: Any) -> Any:
            native = original(*args, **kwargs)
            return None if native is None else _TimedFetch(native)
        return opened

    def fetched(original: Any) -> Any:
        def wrapper(self: Any, records: list[Any]) -> Any:
            now = time.monotonic_ns()
            for record in records:
                _stamp(record.partition, record.offset, "fetched", now)
            return original(self, records)
        return wrapper

    def route(original: Any) -> Any:
        def wrapper(self: Any, kind: type, event: Any, now: float) -> Any:
            if kind is Fetched:
                at = time.monotonic_ns()
                for record in event.records:
                    _stamp(record.partition, record.offset, "taken", at)
            return original(self, kind, event, now)
        return wrapper

    def release(original: Any) -> Any:
        def wrapper(self: Any, now: float) -> Any:
            released = original(self, now)
            _stamp_released(released, "released")
            return released
        return wrapper

    def take(original: Any) -> Any:
        def wrapper(self: Any) -> Any:
            flush, releases = original(self)
            for released in releases:
                _stamp_released(released, "flush start")
            return flush, releases
        return wrapper

    def hand_out(original: Any) -> Any:
        def wrapper(self: Any, released: Any) -> Any:
            _stamp_released(released, "handed out")
            return original(self, released)
        return wrapper

    def acks(original: Any) -> Any:
        def wrapper(self: Any, messages: list[Any], now: float) -> Any:
            at = time.monotonic_ns()
            for message in messages:
                _stamp(message.record.partition, message.record.offset, "ack applied", at)
            return original(self, messages, now)
        return wrapper

    def acks_queued(original: Any) -> Any:  # plain acks: lease handles in the engine's ack queue
        def wrapper(self: Any, queue: Any, now: float) -> Any:
            at = time.monotonic_ns()
            for handle in queue.take():
                lease = self._leases.lease_of(handle)
                if lease is not None:
                    _stamp(lease[0], lease[2], "ack applied", at)
                queue.post(handle)
            return original(self, queue, now)
        return wrapper

    def wait(original: Any) -> Any:
        def wrapper(self: Any, size: int, timeout: float, readable: Any = None) -> Any:
            start = time.monotonic_ns()
            result = original(self, size, timeout, readable)
            INBOX_WAITS.append((size, timeout, time.monotonic_ns() - start))
            return result
        return wrapper

    patch(fetcher_module, "open_native_fetch", open_native_fetch)
    patch(fetcher_module.Fetcher, "fetched", fetched)
    patch(engine_module.Engine, "_route", route)
    patch(dispatch.Dispatcher, "release", release)
    patch(flushes.Flushes, "_take", take)
    patch(dispatch.Dispatcher, "hand_out", hand_out)
    patch(settlement.Settlement, "acks", acks)
    patch(settlement.Settlement, "acks_queued", acks_queued)
    patch(inbox_module.Inbox, "wait", wait)
    _STAMPING[0] = True
    try:
        yield
    finally:
        _STAMPING[0] = False
        for owner, name, original in reversed(patches):
            setattr(owner, name, original)


# -- printing -------------------------------------------------------------------------------------------------
LAYER_STAGES = ("intended", "produced", "fetched", "taken", "released", "flush start", "handed out", "delivered")
RAW_STAGES = ("intended", "produced", "delivered")
STAGE_NAMES = {
    ("intended", "produced"): "producer lag (not the reader)",
    ("produced", "fetched"): "fetch: broker + librdkafka + fetch call",
    ("produced", "delivered"): "broker + librdkafka + poll()",
    ("fetched", "taken"): "coordinator: inbox until its step takes it",
    ("taken", "released"): "coordinator: buffered until released",
    ("released", "flush start"): "Redis flush: waiting for a flush slot",
    ("flush start", "handed out"): "Redis flush: round trip, answer applied",
    ("handed out", "delivered"): "hand-off: to callback / pull / poll",
    ("acked", "ack applied"): "ack: inbox until the coordinator applies it",
    ("ack applied", "released"): "coordinator: ack -> next release",
}


def quantiles(values: list[float]) -> tuple[float, float, float]:
    """p50, p99 and mean of ``values``."""
    ordered = sorted(values)
    if not ordered:
        return float("nan"), float("nan"), float("nan")
    return ordered[len(ordered) // 2], quantile(ordered, 0.99), statistics.fmean(ordered)


StageRow = tuple[str, str, float, float, float, int]


def stage_rows(stamps: list[dict[str, int]], stages: tuple[str, ...]) -> list[StageRow]:
    """(from, to, p50 ms, p99 ms, mean ms, samples) for each consecutive pair of ``stages``."""
    rows = []
    for start, end in itertools.pairwise(stages):
        values = [(s[end] - s[start]) / _MS for s in stamps if start in s and end in s]
        rows.append((start, end, *quantiles(values), len(values)))
    return rows


def print_stages(title: str, rows: list[StageRow]) -> None:
    """One per-stage table."""
    print(f"  {title}")
    print(f"    {'stage':<70} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'n':>7}")
    for start, end, p50, p99, mean, count in rows:
        name = f"{start} -> {end}: {STAGE_NAMES.get((start, end), '')}"
        print(f"    {name:<70} {p50:8.2f} {p99:8.2f} {mean:8.2f} {count:7d}")


def print_waits() -> None:
    """The native fetch's calls and the coordinator's inbox waits of the instrumented run."""
    if FETCH_CALLS:
        with_records = [(t, w, n) for t, w, n in FETCH_CALLS if n]
        waited = [w / _MS for _, w, _ in with_records]
        sizes = sorted(n for _, _, n in with_records)
        timeouts = sorted({t for t, _, _ in FETCH_CALLS})
        p50, p99, mean = quantiles(waited)
        print(f"    native fetch calls: {len(FETCH_CALLS)} ({len(with_records)} with records), timeouts {timeouts} s; "
              f"calls with records waited p50 {p50:.1f} / p99 {p99:.1f} / mean {mean:.1f} ms, "
              f"records per call p50 {sizes[len(sizes) // 2] if sizes else 0}")
    for size in sorted({s for s, _, _ in INBOX_WAITS}):
        waits = [w / _MS for s, _, w in INBOX_WAITS if s == size]
        p50, p99, mean = quantiles(waits)
        timeouts = sorted({round(t, 4) for s, t, _ in INBOX_WAITS if s == size})
        shown = timeouts if len(timeouts) <= 4 else [timeouts[0], "...", timeouts[-1]]
        print(f"    coordinator inbox waits for {size} event(s): {len(waits)}, waited p50 {p50:.2f} / p99 {p99:.2f} / "
              f"mean {mean:.2f} ms (timeouts {shown} s)")


def latency_scenario(endpoints: Endpoints, admin: Admin, args: argparse.Namespace) -> None:
    """Every rate and mode once per round, rounds interleaved; then the instrumented pass."""
    rates = [float(r) for r in args.rates.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    runs: dict[tuple[str, float], list[Run]] = {}
    for mode in modes:  # a first, short run of each reader, not counted: the stack's first groups and topics
        measure(endpoints, admin, mode, rates[0], 1.0, 1.0, args.linger_ms)
    for round_ in range(args.rounds):
        for rate in rates:
            for mode in modes:
                run = measure(endpoints, admin, mode, rate, args.seconds, args.warmup, args.linger_ms)
                runs.setdefault((mode, rate), []).append(run)
                print(f"round {round_ + 1} rate {rate:,.0f} {mode:<9} p50 {run.pct(0.5):7.2f}  p99 {run.pct(0.99):7.2f}"
                      f"  p99.9 {run.pct(0.999):7.2f}  max {run.pct(1.0):8.2f} ms  n {len(run.latencies)}"
                      f"  missing {run.missing}  producer lag p99 {quantile(run.producer_lag, 0.99):.2f} ms",
                      flush=True)
    print(f"\nOpen-loop latency (ms from intended send time), {PAYLOAD_BYTES} B over {KEYS} keys, {PARTITIONS} "
          f"partitions, first {args.warmup:g} s left out, {args.seconds:g} s measured, medians of {args.rounds} "
          f"interleaved rounds; layer - raw: medians of the per-round differences; a message still missing at the "
          f"end counts with its wait so far (a lower bound)")
    print(f"{'rate':>8} {'mode':<9} {'p50':>7} {'p99':>7} {'p99.9':>7} {'max':>8} | {'+p50':>7} {'+p99':>7} "
          f"{'+p99.9':>7} {'+max':>8} | {'prod lag p99':>12} {'missing':>7}")
    qs = (0.5, 0.99, 0.999, 1.0)
    for rate in rates:
        for mode in modes:
            mine = runs[(mode, rate)]
            figures = [statistics.median(r.pct(q) for r in mine) for q in qs]
            raw = runs.get(("raw", rate))
            if mode != "raw" and raw:
                deltas = [statistics.median(a.pct(q) - b.pct(q) for a, b in zip(mine, raw, strict=True)) for q in qs]
                delta_text = " ".join(f"{d:7.2f}" for d in deltas[:3]) + f" {deltas[3]:8.2f}"
            else:
                delta_text = f"{'':>7} {'':>7} {'':>7} {'':>8}"
            lag = statistics.median(quantile(r.producer_lag, 0.99) for r in mine)
            print(f"{rate:8,.0f} {mode:<9} " + " ".join(f"{f:7.2f}" for f in figures[:3]) + f" {figures[3]:8.2f} | "
                  + delta_text + f" | {lag:12.2f} {max(r.missing for r in mine):7d}")
    if not args.stages:
        return
    print(f"\nPer-stage times, one instrumented pass per rate (one message in {SAMPLE} stamped, by offset; the "
          "wrappers add their own cost)")
    with instrumented():
        for rate in rates:
            for mode in modes:
                run = measure(endpoints, admin, mode, rate, args.seconds, args.warmup, args.linger_ms)
                stamps = list(run.stamps.values())
                print(f"rate {rate:,.0f} msg/s, {mode}: p50 {run.pct(0.5):.2f} ms, p99 {run.pct(0.99):.2f} ms "
                      f"({len(stamps)} stamped)")
                print_stages("stages", stage_rows(stamps, RAW_STAGES if mode == "raw" else LAYER_STAGES))
                if mode != "raw":
                    print_waits()


# -- scenario (i): hot keys -----------------------------------------------------------------------------------
def publish_keys(endpoints: Endpoints, topic: str, keys: list[str]) -> None:
    """One 100-byte message per entry of ``keys``, in order."""
    value = b"x" * PAYLOAD_BYTES
    with OrderedProducer(endpoints.kafka_config()) as producer:
        for key in keys:
            producer.produce(topic, value, key=key)


def zipf_keys(count: int, keys: int = KEYS, s: float = 1.1, seed: int = 36) -> list[str]:
    """``count`` keys drawn from ``keys`` keys with Zipf weights 1 / rank^s (seeded)."""
    weights = [1.0 / (rank ** s) for rank in range(1, keys + 1)]
    return [f"key-{k}" for k in random.Random(seed).choices(range(keys), weights=weights, k=count)]


def hot_key_cycle(endpoints: Endpoints, admin: Admin, topic: str, count: int, workers: int) -> None:
    """The one-key topic read once more by the callback, instrumented: the ack -> next delivery
    cycle of the key, stage by stage (every message stamped)."""
    global SAMPLE
    sample, SAMPLE = SAMPLE, 1
    name = f"hot-cycle-{uuid.uuid4().hex[:8]}"
    admin.create_subscription(name, topic=topic)
    done = threading.Event()
    acked = [0]

    def callback(message: Message) -> None:
        record = message.record
        now = time.monotonic_ns()
        _stamp(record.partition, record.offset, "delivered", now)
        _stamp(record.partition, record.offset, "acked", time.monotonic_ns())
        message.ack()
        acked[0] += 1
        if acked[0] >= count:
            done.set()

    try:
        with instrumented():
            STAMPS.clear()
            handle = Subscriber(endpoints.kafka_config(), redis_url=endpoints.redis_url).subscribe(
                name, callback, max_workers=workers)
            done.wait(600)
            handle.cancel()
    finally:
        SAMPLE = sample
    cycles = []
    for (partition, offset), stages in STAMPS.items():
        before = STAMPS.get((partition, offset - 1))
        if before is None or "acked" not in before or "delivered" not in stages:
            continue
        if stages.get("taken", 1 << 62) > before["acked"]:
            continue  # not fetched yet when the previous one was acked: not the cycle
        cycles.append({"acked": before["acked"], "ack applied": before.get("ack applied", 0),
                       **{k: v for k, v in stages.items() if k in ("released", "flush start", "handed out",
                                                                  "delivered")}})
    cycle_stages = ("acked", "ack applied", "released", "flush start", "handed out", "delivered")
    total = [(c["delivered"] - c["acked"]) / _MS for c in cycles]
    p50, p99, mean = quantiles(total)
    print(f"\nOne key: the ack -> next delivery cycle, stage by stage ({len(cycles)} cycles; whole cycle p50 "
          f"{p50:.3f} / p99 {p99:.3f} / mean {mean:.3f} ms, i.e. {1000 / mean if mean else 0:,.0f} msg/s at most)")
    print_stages("stages", stage_rows(cycles, cycle_stages))
    print_waits()


def hotkeys_scenario(endpoints: Endpoints, admin: Admin, args: argparse.Namespace) -> None:
    """Scenario (i): one key, 1,000 uniform keys and 1,000 Zipf keys; raw vs the layer's front ends."""
    cases = {"one key": [f"key-{KEYS + 1}"] * args.hot_messages,
             "1,000 keys uniform": [f"key-{i % KEYS}" for i in range(args.keyed_messages)],
             "1,000 keys Zipf s=1.1": zipf_keys(args.keyed_messages)}
    topics = {}
    for case, keys in cases.items():
        topic = f"hot-{uuid.uuid4().hex[:8]}"
        admin.create_topic(topic, partitions=PARTITIONS)
        publish_keys(endpoints, topic, keys)
        topics[case] = topic
    zipf = cases["1,000 keys Zipf s=1.1"]
    hottest = max(set(zipf), key=zipf.count)
    print(f"Zipf s=1.1 over {KEYS} keys: the hottest key ({hottest}) has {zipf.count(hottest):,} of {len(zipf):,} "
          "messages", flush=True)
    fronts = ("raw", "callback", "pull", "consumer")
    rates: dict[tuple[str, str], list[float]] = {}
    for round_ in range(args.rounds):  # --rounds 0: the instrumented passes only
        for case, topic in topics.items():
            count = len(cases[case])
            measured = {"raw": raw_consume(endpoints, topic, count),
                        "callback": layer_consume(endpoints, admin, topic, count, args.workers),
                        "pull": layer_pull(endpoints, admin, topic, count),
                        "consumer": layer_ordered_consumer(endpoints, topic, count)}
            for front, rate in measured.items():
                rates.setdefault((case, front), []).append(rate)
            print(f"round {round_ + 1} {case:<22} " + ", ".join(f"{f} {r:,.0f}" for f, r in measured.items())
                  + " msg/s", flush=True)
    if args.rounds < 1:
        if args.stages:
            hot_key_cycle(endpoints, admin, topics["one key"], len(cases["one key"]), args.workers)
            zipf_hot_key(endpoints, admin, topics["1,000 keys Zipf s=1.1"], zipf, hottest, args.workers)
        return
    print(f"\nScenario (i), no-op acking callback ({args.workers} workers), pull (500, batch ack), OrderedConsumer "
          f"(consume 500, ack each); msg/s, medians of {args.rounds} interleaved rounds; ratio: median of the "
          "per-round layer / raw")
    print(f"{'keys':<24} {'raw':>12} " + " ".join(f"{f:>10} {'ratio':>7}" for f in fronts[1:]))
    for case in cases:
        raw = rates[(case, "raw")]
        cells = []
        for front in fronts[1:]:
            mine = rates[(case, front)]
            ratio = statistics.median(a / b for a, b in zip(mine, raw, strict=True))
            cells.append(f"{statistics.median(mine):10,.0f} {ratio:7.3f}")
        print(f"{case:<24} {statistics.median(raw):12,.0f} " + " ".join(cells))
    uniform = "1,000 keys uniform"
    for front in fronts[1:]:
        ratio = statistics.median(a / b for a, b in zip(rates[("1,000 keys Zipf s=1.1", front)],
                                                        rates[(uniform, front)], strict=True))
        print(f"  {front}: Zipf / uniform {ratio:.3f} (goal >= 0.5)")
    if args.stages:
        hot_key_cycle(endpoints, admin, topics["one key"], len(cases["one key"]), args.workers)
        zipf_hot_key(endpoints, admin, topics["1,000 keys Zipf s=1.1"], zipf, hottest, args.workers)


def zipf_hot_key(endpoints: Endpoints, admin: Admin, topic: str, keys: list[str], hottest: str,
                 workers: int) -> None:
    """The Zipf topic read once more by the callback, instrumented: the gaps between the hottest
    key's deliveries (whether its next message was fetched already), the coordinator's inbox waits
    and the flow-control gate's holds and pauses."""
    global SAMPLE
    sample, SAMPLE = SAMPLE, 1
    gate_changes: list[tuple[str, bool]] = []
    pauses = [0]
    name = f"zipf-cycle-{uuid.uuid4().hex[:8]}"
    admin.create_subscription(name, topic=topic)
    done = threading.Event()
    hot: list[tuple[int, int, int]] = []  # the hottest key's deliveries: (delivered ns, partition, offset)
    count = [0]

    def callback(message: Message) -> None:
        if message.ordering_key == hottest:
            hot.append((time.monotonic_ns(), message.record.partition, message.record.offset))
        message.ack()
        count[0] += 1
        if count[0] >= len(keys):
            done.set()

    update, pause = flow_module.FlowGate.update, fetcher_module.Fetcher._pause

    def watched_update(self: Any, *args: Any, **kwargs: Any) -> None:
        before = (self.state, self.ample)
        update(self, *args, **kwargs)
        if (self.state, self.ample) != before:
            gate_changes.append((self.state.value, self.ample))

    def watched_pause(self: Any, partitions: Any, paused: bool) -> None:
        pauses[0] += int(paused)
        pause(self, partitions, paused)

    setattr(flow_module.FlowGate, "update", watched_update)  # noqa: B010 - a wrapper, put back below
    setattr(fetcher_module.Fetcher, "_pause", watched_pause)  # noqa: B010
    try:
        with instrumented():
            STAMPS.clear()
            INBOX_WAITS.clear()
            FETCH_CALLS.clear()
            start = time.monotonic()
            handle = Subscriber(endpoints.kafka_config(), redis_url=endpoints.redis_url).subscribe(
                name, callback, max_workers=workers)
            done.wait(600)
            elapsed = time.monotonic() - start
            handle.cancel()
    finally:
        SAMPLE = sample
        setattr(flow_module.FlowGate, "update", update)  # noqa: B010
        setattr(fetcher_module.Fetcher, "_pause", pause)  # noqa: B010
    gaps = [(b[0] - a[0]) / _MS for a, b in itertools.pairwise(hot)]
    not_fetched = sum(1 for a, b in itertools.pairwise(hot) if STAMPS.get((b[1], b[2]), {}).get("taken", 0) > a[0])
    p50, p99, mean = quantiles(gaps)
    span = (hot[-1][0] - hot[0][0]) / 1e9 if hot else 0.0
    print(f"\nZipf s=1.1, instrumented: {len(keys):,} messages in {elapsed:.1f} s (join included); the hottest key "
          f"({hottest}, {len(hot):,} messages) was delivered over {span:.1f} s; gaps between its deliveries p50 "
          f"{p50:.3f} / p90 {quantile(sorted(gaps), 0.9):.3f} / p99 {p99:.3f} / mean {mean:.3f} ms; its next message "
          f"not fetched yet at a delivery: {not_fetched} times")
    held = sum(1 for state, _ in gate_changes if state == "held")
    print(f"    flow-control gate: {held} holds (max_buffered reached), {pauses[0]} pauses of the assignment")
    print_waits()


# -- redelivery: a nack with no backoff ------------------------------------------------------------------------
def redelivery_round(endpoints: Endpoints, admin: Admin, messages: int, workers: int) -> list[float]:
    """One round of ``redelivery_scenario``: the ms from each message's nack to its redelivery."""
    topic, name = f"redeliver-{uuid.uuid4().hex[:8]}", f"redeliver-sub-{uuid.uuid4().hex[:8]}"
    admin.create_topic(topic, partitions=6)
    admin.create_subscription(name, topic=topic, retry_policy=RetryPolicy(0, 0))
    publish_keys(endpoints, topic, [f"key-{n % KEYS}" for n in range(messages)])
    nacked: dict[str, int] = {}
    waits: list[float] = []
    lock, done = threading.Lock(), threading.Event()

    def callback(message: Message) -> None:
        now = time.monotonic_ns()
        with lock:
            if message.delivery_attempt == 1:
                nacked[message.message_id] = time.monotonic_ns()
                message.nack()
                return
            waits.append((now - nacked[message.message_id]) / 1e6)
            finished = len(waits) >= messages
        message.ack()
        if finished:
            done.set()

    subscriber = Subscriber(endpoints.kafka_config(), redis_url=endpoints.redis_url)
    with subscriber.subscribe(name, callback, max_workers=workers):
        done.wait(300)
    subscriber.close()
    return waits


def redelivery_scenario(endpoints: Endpoints, admin: Admin, args: argparse.Namespace) -> None:
    """Item 4 of issue 36: with ``minimum_backoff=0`` a nacked message is delivered again promptly.
    ``--redeliveries`` messages over 1,000 keys (published beforehand); the callback nacks each
    message's first delivery and acks its second; per message, the time from its ``nack()`` call to
    the start of its redelivery's callback. Rounds are separate topics; medians of the rounds."""
    rows: list[tuple[float, float, float, float]] = []
    for round_ in range(max(1, args.rounds)):
        waits = sorted(redelivery_round(endpoints, admin, args.redeliveries, args.workers))
        row = (quantile(waits, 0.5), quantile(waits, 0.99), quantile(waits, 0.999), waits[-1])
        rows.append(row)
        print(f"round {round_ + 1} redelivery after nack (backoff 0): p50 {row[0]:.2f}  p99 {row[1]:.2f}  "
              f"p99.9 {row[2]:.2f}  max {row[3]:.2f} ms  n {len(waits)}", flush=True)
    medians = [statistics.median(row[i] for row in rows) for i in range(4)]
    print(f"\nRedelivery after a nack, minimum_backoff=0, {args.redeliveries} messages over {KEYS} keys, "
          f"medians of {len(rows)} rounds: p50 {medians[0]:.2f}  p99 {medians[1]:.2f}  p99.9 {medians[2]:.2f}  "
          f"max {medians[3]:.2f} ms (goal p99 <= 10)")
    redelivery_open_loop(endpoints, admin, args)


def redelivery_open_loop(endpoints: Endpoints, admin: Admin, args: argparse.Namespace) -> None:
    """Redelivery as the latency scenario measures delivery: the paced stream at each rate, each
    message nacked at its first delivery (``start_nacking``); per message of the measured window,
    the time from its nack to its redelivery's callback. Medians of the rounds."""
    rates = [float(r) for r in args.rates.split(",")]
    rows: dict[float, list[tuple[float, float, float, float]]] = {}
    for round_ in range(max(1, args.rounds)):
        for rate in rates:
            NACKED_AT.clear()
            REDELIVERED.clear()
            run = measure(endpoints, admin, "nacking", rate, args.seconds, args.warmup, args.linger_ms)
            cutoff = min((intended for intended, _ in REDELIVERED), default=0) + int(args.warmup * 1e9)
            waits = sorted(wait for intended, wait in REDELIVERED if intended >= cutoff)
            if not waits:
                continue
            row = (quantile(waits, 0.5), quantile(waits, 0.99), quantile(waits, 0.999), waits[-1])
            rows.setdefault(rate, []).append(row)
            print(f"round {round_ + 1} rate {rate:,.0f} redelivery after nack: p50 {row[0]:.2f}  p99 {row[1]:.2f}  "
                  f"p99.9 {row[2]:.2f}  max {row[3]:.2f} ms  n {len(waits)}  (send -> redelivery p50 "
                  f"{run.pct(0.5):.2f}, missing {run.missing})", flush=True)
    print(f"\nRedelivery after a nack, open loop (each message of a paced stream nacked once), minimum_backoff=0, "
          f"{KEYS} keys, first {args.warmup:g} s left out, {args.seconds:g} s measured, medians of the rounds:")
    for rate, mine in rows.items():
        medians = [statistics.median(row[i] for row in mine) for i in range(4)]
        print(f"{rate:8,.0f} msg/s: p50 {medians[0]:.2f}  p99 {medians[1]:.2f}  p99.9 {medians[2]:.2f}  "
              f"max {medians[3]:.2f} ms (goal p99 <= 10)")


def main() -> None:
    """Run the chosen scenario(s) and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=("latency", "hotkeys", "redelivery", "all"), default="latency")
    parser.add_argument("--rates", default="200,2000,20000,100000", help="msg/s, comma-separated")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per rate and mode")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of each stream left out first")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES), help="of raw,callback,pull,consumer")
    parser.add_argument("--linger-ms", type=float, default=0.0, help="the paced producer's linger.ms")
    parser.add_argument("--no-stages", dest="stages", action="store_false", help="skip the instrumented passes")
    parser.add_argument("--hot-messages", type=int, default=20_000, help="messages of the one-key case")
    parser.add_argument("--keyed-messages", type=int, default=100_000, help="messages of the 1,000-key cases")
    parser.add_argument("--workers", type=int, default=16, help="callback workers of scenario (i)")
    parser.add_argument("--redeliveries", type=int, default=20_000, help="messages of the redelivery scenario")
    args = parser.parse_args()
    with bench_stack() as endpoints:
        admin = Admin(endpoints.kafka_config(), redis_url=endpoints.redis_url)
        if args.scenario in ("latency", "all"):
            latency_scenario(endpoints, admin, args)
        if args.scenario in ("hotkeys", "all"):
            hotkeys_scenario(endpoints, admin, args)
        if args.scenario in ("redelivery", "all"):
            redelivery_scenario(endpoints, admin, args)


if __name__ == "__main__":
    main()
