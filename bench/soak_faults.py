"""The chaos soak's moving parts: prober processes (publishers, subscribers, the checker), the
subscriber killer, broker and Redis faults, and the producer's connection cut.

Every fault that may make acked messages come again (a broker restart, a Redis restart or
FLUSHALL) is appended to ``<events>/faults.jsonl`` as a ``Fault``; every subscriber process that
dies (SIGKILL, or its own ``os._exit`` on a poison message) as a ``Lost`` with its subscriber id,
so that the checker judges what the subscribers recorded knowing what was done to them.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from ordering_layer.prober.eventlog import EventLog
from ordering_layer.prober.events import Fault, Lost
from ordering_layer.stack import Endpoints, LocalStack

_LOGGER = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
_CLI = "from ordering_layer.cli import main; main()"


def prober_command(endpoints: Endpoints, *args: str) -> list[str]:
    """The command line of an ``ordering-layer prober`` process with this checkout's code."""
    return [sys.executable, "-c", _CLI, "prober", "--bootstrap", endpoints.bootstrap, "--redis-url",
            endpoints.redis_url, "--no-progress", *args]


def spawn(command: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
    """Start ``command`` from the repository root, its output appended to ``log``."""
    out: IO[bytes] = open(log, "ab")  # noqa: SIM115 - the child holds it; closed with the process
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        return subprocess.Popen(list(command), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    finally:
        out.close()


@dataclass
class Timeline:
    """What the harness did and when (seconds since the soak started), for the report."""

    started: float = field(default_factory=time.monotonic)
    entries: list[tuple[float, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, what: str) -> None:
        """Record ``what`` now (and log it)."""
        at = round(time.monotonic() - self.started, 1)
        _LOGGER.info("[%7.1f s] %s", at, what)
        with self.lock:
            self.entries.append((at, what))


class SubscriberFleet:
    """``count`` prober consume processes of one subscription, each restarted when it dies.

    Args:
        endpoints: the stack.
        subscription: the subscription (it must exist: the processes do not create it).
        events: the events folder.
        logs: where each process's output goes.
        consume_args: further prober options (nack rate, poison hold, ...).
        faults: the harness's event log (``Lost`` events).
        timeline: the report's timeline.
    """

    def __init__(self, endpoints: Endpoints, subscription: str, events: Path, logs: Path, consume_args: list[str],
                 faults: EventLog, timeline: Timeline, count: int = 3) -> None:
        self._endpoints = endpoints
        self._subscription = subscription
        self._events = events
        self._logs = logs
        self._args = consume_args
        self._faults = faults
        self._timeline = timeline
        self._lock = threading.Lock()
        self._procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._generation = 0
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="soak-fleet", daemon=True)
        self.kills = 0
        self.crashes: dict[int, int] = {}  # exit status -> processes that ended on their own with it
        for slot in range(count):
            self._procs.append(self._start(slot))

    def _start(self, slot: int) -> tuple[str, subprocess.Popen[bytes]]:
        self._generation += 1
        name = f"sub{slot}-{self._generation}"
        proc = spawn(prober_command(self._endpoints, "--mode", "consume", "--subscription", self._subscription,
                                    "--events", str(self._events), "--subscriber-id", name, "--idle-timeout", "0",
                                    "-X", "session.timeout.ms=6000", *self._args),
                     self._logs / f"{name}.log")
        return name, proc

    def start(self) -> None:
        """Start watching for processes that die on their own (restarted at once)."""
        self._watcher.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            with self._lock:
                for slot, (name, proc) in enumerate(self._procs):
                    status = proc.poll()
                    if status is None:
                        continue
                    self._faults(Lost(time.time(), name))
                    self.crashes[status] = self.crashes.get(status, 0) + 1
                    self._timeline.note(f"{name} ended with status {status}; restarted")
                    self._procs[slot] = self._start(slot)

    def kill_one(self, rng: random.Random) -> None:
        """SIGKILL one process chosen at random, report it lost, start a new one in its place."""
        with self._lock:
            slot = rng.randrange(len(self._procs))
            name, proc = self._procs[slot]
            if proc.poll() is not None:
                return  # died on its own: the watcher restarts it
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            self._faults(Lost(time.time(), name))
            self.kills += 1
            self._procs[slot] = self._start(slot)

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the watcher, then every process with SIGTERM (it settles and flushes its events);
        one still running after ``timeout`` is killed and reported lost."""
        self._stop.set()
        if self._watcher.is_alive():
            self._watcher.join()
        with self._lock:
            for _, proc in self._procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for name, proc in self._procs:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(30)
                    self._faults(Lost(time.time(), name))


def kill_subscribers_until(fleet: SubscriberFleet, every: tuple[float, float], stop: threading.Event,
                           seed: int) -> None:
    """Kill a random subscriber process every ``every`` (low, high) seconds until ``stop``."""
    rng = random.Random(seed)
    while not stop.wait(rng.uniform(*every)):
        fleet.kill_one(rng)


# -- the cluster --------------------------------------------------------------------------------------
def _admin(endpoints: Endpoints) -> AdminClient:
    return AdminClient({"bootstrap.servers": endpoints.bootstrap,
                        "logger": logging.getLogger("ordering_layer.kafka.client")})  # type: ignore[dict-item]


def cluster_healthy(endpoints: Endpoints, brokers: int = 3) -> bool:
    """Every broker answers and every partition (internal ones too) has a leader and a full ISR."""
    try:
        metadata = _admin(endpoints).list_topics(timeout=10)
    except KafkaException:
        return False
    if len(metadata.brokers) < brokers:
        return False
    return all(p.leader >= 0 and len(p.isrs) == len(p.replicas)
               for topic in metadata.topics.values() for p in topic.partitions.values())


def busiest_leader(endpoints: Endpoints, topic: str, spare: int | None = None) -> int:
    """The broker leading most partitions of ``topic`` (other than ``spare`` when it can)."""
    metadata = _admin(endpoints).list_topics(topic, timeout=30)
    led: dict[int, int] = {}
    for p in metadata.topics[topic].partitions.values():
        led[p.leader] = led.get(p.leader, 0) + 1
    ranked = sorted((n for n in led if n >= 0), key=lambda n: -led[n])
    choices = [n for n in ranked if n != spare] or ranked or [1]
    return choices[0]


def kill_and_restart_broker(stack: LocalStack, endpoints: Endpoints, topic: str, down_for: float,
                            faults: EventLog, timeline: Timeline, spare: int | None = None) -> int:
    """SIGKILL the busiest leader of ``topic``, keep it down ``down_for`` seconds, restart it;
    return its node id."""
    node = busiest_leader(endpoints, topic, spare)
    stack.stop_broker(node=node, kill=True)
    faults(Fault(time.time(), f"broker-{node}-killed"))
    timeline.note(f"broker {node} killed (SIGKILL)")
    time.sleep(down_for)  # the outage itself: how long the broker stays down
    stack.start_broker(node=node)
    faults(Fault(time.time(), f"broker-{node}-restarted"))
    timeline.note(f"broker {node} restarted")
    return node


def restart_redis(stack: LocalStack, faults: EventLog, timeline: Timeline) -> None:
    """SIGKILL Redis and start it again (its append-only file may miss the last second)."""
    stack.stop_redis(kill=True)
    faults(Fault(time.time(), "redis-killed"))
    timeline.note("redis killed (SIGKILL)")
    stack.start_redis()
    timeline.note("redis restarted")


def cut_connections(pid: int, ports: set[int], seconds: float, timeline: Timeline) -> int:
    """Destroy every TCP connection of process ``pid`` to ``ports`` (``ss -K``, as a network cut
    does: the process sees ECONNABORTED), again and again for ``seconds`` so that its reconnects
    fail too; return the connections destroyed."""
    timeline.note(f"cutting the connections of process {pid} to the brokers for {seconds:.0f} s")
    destroyed = 0
    deadline = time.monotonic() + seconds
    pattern = re.compile(rf"\S+:(\d+)\s+\S+:(\d+)\s+users:\(\(.*pid={pid},")
    while time.monotonic() < deadline:
        listing = subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True, text=True,
                                 check=False).stdout
        for match in pattern.finditer(listing):
            local, peer = int(match.group(1)), int(match.group(2))
            if peer in ports:
                killed = subprocess.run(["ss", "-K", "-tnH", "dst", f":{peer}", "src", f":{local}"],
                                        capture_output=True, text=True, check=False)
                destroyed += sum(1 for line in killed.stdout.splitlines() if line.strip())
        time.sleep(0.05)  # the cut holds: new connections are destroyed as soon as they show
    timeline.note(f"connection cut over: {destroyed} connection(s) destroyed")
    return destroyed


def committed_and_end(endpoints: Endpoints, group: str, topic: str, partitions: int) -> tuple[int, int]:
    """Sum over the topic's partitions of the group's committed offset and of the end offset (read
    from Kafka only: Redis may have been flushed)."""
    consumer = Consumer({"bootstrap.servers": endpoints.bootstrap, "group.id": group, "enable.auto.commit": False,
                         "logger": logging.getLogger("ordering_layer.kafka.client")})
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        committed = sum(max(0, tp.offset) for tp in consumer.committed(tps, timeout=30))
        end = sum(consumer.get_watermark_offsets(tp, timeout=30)[1] for tp in tps)
        return committed, end
    finally:
        consumer.close()


def broker_ports(endpoints: Endpoints) -> set[int]:
    """The brokers' listener ports."""
    return {int(address.rsplit(":", 1)[1]) for address in endpoints.bootstrap.split(",")}


def parse_json_file(path: Path) -> dict[str, Any]:
    """A JSON summary a prober process wrote (empty when it wrote none)."""
    try:
        result: dict[str, Any] = json.loads(path.read_text())
        return result
    except (OSError, ValueError):
        return {}


class AckTally:
    """Messages acked per prober run, read from the subscribers' event files as they grow: what the
    harness waits on. An ack counts when it is confirmed (``ack_ok``) or sent (``ack``), as the
    checker counts it: a subscriber killed between sending an ack and logging its confirmation
    leaves only the request, and a message whose ack took effect is never delivered again. An ack
    that did not take effect is redelivered; the harness then also waits for the committed offsets
    to reach the end offsets, which they cannot while a message is unsettled."""

    def __init__(self, events: Path) -> None:
        self._events = events
        self._offsets: dict[Path, int] = {}
        self._acked: dict[str, set[tuple[str, int]]] = {}

    def acked(self, run: str) -> int:
        """Distinct messages of ``run`` acked so far (reads what is new first)."""
        self._read()
        return len(self._acked.get(run, ()))

    def messages(self, run: str) -> set[tuple[str, str, int]]:
        """The distinct messages of ``run`` acked so far, as (run, key, seq)."""
        self._read()
        return {(run, key, seq) for key, seq in self._acked.get(run, ())}

    def _read(self) -> None:
        for path in self._events.glob("sub*.jsonl"):
            with open(path, "rb") as file:
                file.seek(self._offsets.get(path, 0))
                chunk = file.read()
            complete = chunk.rfind(b"\n") + 1
            self._offsets[path] = self._offsets.get(path, 0) + complete
            for line in chunk[:complete].splitlines():
                if b'"outcome":"ack"' in line or b'"outcome":"ack_ok"' in line:
                    event = json.loads(line)
                    if event["run"] is not None:
                        self._acked.setdefault(event["run"], set()).add((event["key"], event["seq"]))
