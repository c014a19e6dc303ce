"""The chaos soak (issue 12): the prober under sustained load on a three-broker cluster while faults
overlap, judged from the subscribers' own records. ``make soak`` runs the full plan, ``make
soak-short`` (and ``tests/integration/test_soak.py``) the two-minute one.

The run, on a subscription with ordering, a dead-letter policy (5 attempts, 0.2..2 s backoff) and a
short ``max_lease_duration``:

1. *Calm phase*: 3 subscriber processes (``prober --mode consume``, 1 % random nacks) consume a
   first publish with no fault: the fault-free throughput.
2. *Chaos phase*: a publisher process (``prober --mode publish``, paced) publishes the rest after
   three poison messages (nacked forever; ``os._exit`` on every delivery; held past its lease),
   while: one subscriber process is killed with SIGKILL every few seconds and restarted; the
   busiest partition leader is killed with SIGKILL and restarted (twice in the full plan); Redis is
   killed and restarted; the publisher's broker connections are cut (``ss -K`` destroys its TCP
   connections, again as they reconnect, for a few seconds); Redis is FLUSHALL'd; the topic grows
   (twice in the full plan, once in the short one: moved keys must keep their order, SUB-8).
3. *Drain*: every message settled (committed offsets at the end offsets), the subscribers stopped,
   the dead-letter topic read (``Admin.list_dead_letters``), its prober messages reported to the
   checker as settled, and ``prober --mode check --from-events`` judges every record.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis

from bench.soak_faults import (
    AckTally,
    SubscriberFleet,
    Timeline,
    broker_ports,
    cluster_healthy,
    committed_and_end,
    cut_connections,
    kill_and_restart_broker,
    kill_subscribers_until,
    parse_json_file,
    prober_command,
    restart_redis,
    spawn,
)
from ordering_layer import Admin, DeadLetterPolicy, RetryPolicy
from ordering_layer.prober.eventlog import EventLog
from ordering_layer.prober.events import ATTR_POISON, ATTR_RUN, ATTR_SEQ, POISONS, DeadLettered, Fault
from ordering_layer.stack import LocalStack

_LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class SoakPlan:
    """The size of a soak and of its faults (seconds unless named otherwise)."""

    name: str
    messages: int  # published in all (calm + chaos), poison messages aside
    calm_messages: int
    keys: int
    publish_rate: float  # chaos-phase messages per second: publishing spans the faults
    fault_window: float  # the scheduled faults are spread over this many seconds
    broker_kills: int = 2
    growths: tuple[int, ...] = ()  # partition counts the topic grows to during the faults (SUB-8)
    broker_down: float = 8.0
    kill_every: tuple[float, float] = (3.0, 5.0)
    cut_seconds: float = 5.0
    partitions: int = 12
    nack_rate: float = 0.01
    max_delivery_attempts: int = 5
    ack_deadline: float = 10.0
    max_lease_duration: float = 2.0
    poison_hold: float = 20.0  # > ack_deadline + max_lease_duration: its ack comes after the redelivery
    settle_timeout: float = 600.0
    seed: int = 12


FULL = SoakPlan("full", messages=100_000, calm_messages=10_000, keys=1000, publish_rate=600, fault_window=150,
                growths=(18, 24))
SHORT = SoakPlan("short", messages=20_000, calm_messages=2_000, keys=500, publish_rate=300, fault_window=50,
                 broker_kills=1, broker_down=5.0, cut_seconds=3.0, settle_timeout=300, growths=(18,))


def wait_for(check: Callable[[], bool], timeout: float, interval: float = 0.5) -> bool:
    """Poll ``check`` until true or ``timeout``; return the last result."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


class Soak:
    """One soak run of ``plan`` against ``stack`` (a running three-broker LocalStack), in ``workdir``."""

    def __init__(self, plan: SoakPlan, stack: LocalStack, workdir: Path) -> None:
        self.plan = plan
        self.stack = stack
        self.endpoints = stack.endpoints()
        self.workdir = workdir
        self.events = workdir / "events"
        self.logs = workdir / "logs"
        for folder in (self.events, self.logs):
            folder.mkdir(parents=True, exist_ok=True)
        self.timeline = Timeline()
        self.faults = EventLog(self.events / "faults.jsonl")
        name = f"soak-{plan.name}-{uuid.uuid4().hex[:8]}"
        self.topic, self.subscription, self.dlq = name, f"{name}-sub", f"{name}-dlq"
        self.admin = Admin({"bootstrap.servers": self.endpoints.bootstrap}, redis_url=self.endpoints.redis_url)
        self.figures: dict[str, Any] = {"plan": asdict(plan), "workdir": str(workdir)}
        self.partitions = plan.partitions
        self.tally = AckTally(self.events)

    # -- phases -------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Run the phases; return the figures (``ok`` says whether every goal was met)."""
        plan = self.plan
        if not wait_for(lambda: cluster_healthy(self.endpoints), 180, 1.0):
            raise RuntimeError("the cluster is not healthy: 3 brokers with every replica in sync")
        self.admin.create_topic(self.topic, partitions=plan.partitions)
        self.admin.create_subscription(
            self.subscription, topic=self.topic, ack_deadline=plan.ack_deadline,
            retry_policy=RetryPolicy(minimum_backoff=0.2, maximum_backoff=2.0),
            dead_letter_policy=DeadLetterPolicy(self.dlq, plan.max_delivery_attempts),
            max_lease_duration=plan.max_lease_duration)
        self.timeline.note(f"topic {self.topic} ({plan.partitions} partitions, 3 replicas), subscription ready")
        fleet = SubscriberFleet(self.endpoints, self.subscription, self.events, self.logs,
                                ["--nack-rate", str(plan.nack_rate), "--delay-ms", "0-2", "--workers", "8",
                                 "--poison-hold-ms", str(plan.poison_hold * 1000)],
                                self.faults, self.timeline)
        fleet.start()
        started = time.monotonic()
        try:
            self._calm()
            self._chaos(fleet)
            self._drain()
        finally:
            fleet.stop()
            self.figures["subscriber_kills"] = fleet.kills
            self.figures["subscriber_exits"] = {str(k): v for k, v in sorted(fleet.crashes.items())}
        self._dead_letters()
        self.faults.close()
        self._check()
        self.figures["wall_seconds"] = round(time.monotonic() - started, 1)
        self.figures["timeline"] = self.timeline.entries
        self.figures["ok"] = self._goals_met()
        return self.figures

    def _publisher(self, run_id: str, messages: int, *extra: str) -> Any:
        summary = self.logs / f"publish-{run_id}.json"
        proc = spawn(prober_command(self.endpoints, "--mode", "publish", "--topic", self.topic, "--run-id", run_id,
                                    "--keys", str(self.plan.keys), "--messages", str(messages),
                                    "--events", str(self.events), "--summary", str(summary), *extra),
                     self.logs / f"publish-{run_id}.log")
        return proc, summary

    def _offsets(self) -> tuple[int, int]:
        return committed_and_end(self.endpoints, self.subscription, self.topic, self.partitions)

    def _calm(self) -> None:
        """Publish the calm share with no fault and time its consumption (from the first ack on)."""
        proc, summary = self._publisher("calm", self.plan.calm_messages)
        first: list[float] = []

        def drained() -> bool:
            acked = self.tally.acked("calm")
            if acked and not first:
                first.append(time.monotonic())
            return proc.poll() is not None and acked == self.plan.calm_messages

        if not wait_for(drained, self.plan.settle_timeout):
            raise RuntimeError("the calm phase did not drain")
        seconds = time.monotonic() - (first[0] if first else self.timeline.started)
        self.figures["calm"] = {"messages": self.plan.calm_messages, "seconds": round(seconds, 1),
                                "throughput_per_s": round(self.plan.calm_messages / max(seconds, 1e-3), 1),
                                "publish": parse_json_file(summary).get("publish", {})}
        self.timeline.note(f"calm phase drained: {self.figures['calm']['throughput_per_s']} msg/s")

    def _chaos(self, fleet: SubscriberFleet) -> None:
        plan = self.plan
        started = time.monotonic()
        proc, summary = self._publisher("chaos", plan.messages - plan.calm_messages, "--rate", str(plan.publish_rate),
                                        *(arg for kind in POISONS for arg in ("--poison", kind)))
        self.timeline.note("chaos phase: publisher started (3 poison messages first)")
        stop_killing = threading.Event()
        killer = threading.Thread(target=kill_subscribers_until, args=(fleet, plan.kill_every, stop_killing, plan.seed),
                                  name="soak-killer", daemon=True)
        killer.start()
        window = plan.fault_window
        steps: list[tuple[float, Callable[[], None]]] = [
            (0.30, lambda: restart_redis(self.stack, self.faults, self.timeline)),
            (0.45, lambda: self._cut(proc.pid)),
            (0.80, self._flushall)]
        for index, count in enumerate(plan.growths):
            steps.append((0.20 + 0.40 * index, functools.partial(self._grow, count)))
        victims: list[int] = []
        for index in range(plan.broker_kills):
            steps.append((0.10 + 0.50 * index, lambda: victims.append(kill_and_restart_broker(
                self.stack, self.endpoints, self.topic, plan.broker_down, self.faults, self.timeline,
                spare=victims[-1] if victims else None))))
        for fraction, step in sorted(steps, key=lambda s: s[0]):
            delay = started + fraction * window - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # the schedule: faults at set points of the window
            step()
        proc.wait(plan.settle_timeout)
        stop_killing.set()
        killer.join()
        seconds = time.monotonic() - started
        acked = self.tally.acked("chaos")
        self.timeline.note("faults over")
        self.figures["chaos"] = {"messages": plan.messages - plan.calm_messages, "seconds": round(seconds, 1),
                                 "acked_during_faults": acked,
                                 "throughput_per_s": round(acked / seconds, 1),
                                 "publish": parse_json_file(summary).get("publish", {}),
                                 "brokers_killed": victims}

    def _grow(self, count: int) -> None:
        """Add partitions while publishing and consuming (SUB-8: moved keys keep their order)."""
        self.admin.add_partitions(self.topic, count)
        self.partitions = count
        self.timeline.note(f"topic grown to {count} partitions")

    def _cut(self, pid: int) -> None:
        self.figures["connections_cut"] = cut_connections(pid, broker_ports(self.endpoints), self.plan.cut_seconds,
                                                          self.timeline)

    def _flushall(self) -> None:
        """FLUSHALL Redis; nothing is put back: subscribers started afterwards find the subscription's
        settings in their durable copy in Kafka."""
        redis.Redis.from_url(self.endpoints.redis_url).flushall()
        self.faults(Fault(time.time(), "redis-flushall"))
        self.timeline.note("redis FLUSHALL")

    def _drain(self) -> None:
        """Wait until every message is acked or dead-lettered and the three poison messages are
        dead-lettered; then give the committed offsets a while to reach the end offsets."""
        def settled() -> bool:
            # Messages count once whether acked, dead-lettered or both (a redelivery after a lost ack
            # may end in the dead-letter topic); the dead letters are read on every poll.
            done = self.tally.messages("calm") | self.tally.messages("chaos")
            poison, prober = self._letters()
            self.figures["prober_dead_letters"] = len(prober)
            return len(done | prober) >= self.plan.messages and len(poison) == len(POISONS)

        drained = wait_for(settled, self.plan.settle_timeout, 2.0)
        self.figures["drained"] = drained
        self.timeline.note("drained" if drained else "NOT drained within the settle timeout")

        def committed() -> bool:
            done, end = self._offsets()
            self.figures["uncommitted_after_drain"] = end - done
            return done == end

        wait_for(committed, 60, 1.0)
        self.timeline.note(f"committed offsets {self.figures['uncommitted_after_drain']} behind the end offsets")

    def _letters(self) -> tuple[dict[str, int], set[tuple[str, str, int]]]:
        """(poison kind -> delivery attempts, the prober messages as (run, key, seq)) of the
        dead-letter topic."""
        found = {}
        prober = set()
        for letter in self.admin.list_dead_letters(self.subscription):
            headers = {name: (value or b"").decode(errors="replace") for name, value in letter.headers}
            if ATTR_POISON in headers:
                found[headers[ATTR_POISON]] = letter.delivery_attempts
            elif ATTR_RUN in headers and ATTR_SEQ in headers and letter.ordering_key:
                prober.add((headers[ATTR_RUN], letter.ordering_key, int(headers[ATTR_SEQ])))
        return found, prober

    # -- judging -------------------------------------------------------------------------------------
    def _dead_letters(self) -> None:
        """Report the prober messages of the dead-letter topic to the checker (they are settled)."""
        log = EventLog(self.events / "dead-letters.jsonl")
        letters = self.admin.list_dead_letters(self.subscription)
        poison: dict[str, int] = {}
        for letter in letters:
            headers = {name: (value or b"").decode(errors="replace") for name, value in letter.headers}
            if ATTR_POISON in headers:
                poison[headers[ATTR_POISON]] = letter.delivery_attempts
            elif ATTR_RUN in headers and ATTR_SEQ in headers and letter.ordering_key:
                log(DeadLettered(time.time(), headers[ATTR_RUN], letter.ordering_key, int(headers[ATTR_SEQ]),
                                 letter.delivery_attempts))
        log.close()
        self.figures["dead_letters"] = {"records": len(letters), "prober_messages": len(letters) - len(poison),
                                        "poison_attempts": poison}
        self.figures["poison_deliveries"] = self._poison_deliveries()

    def _poison_deliveries(self) -> dict[str, list[int]]:
        """Poison kind -> the delivery attempts the subscribers recorded for it, in time order."""
        seen: dict[str, list[tuple[float, int]]] = {kind: [] for kind in POISONS}
        for path in self.events.glob("sub*.jsonl"):
            for line in path.read_text().splitlines():
                if "-poison-" in line and '"ev":"delivery"' in line:
                    event = json.loads(line)
                    seen[event["key"].rsplit("-", 1)[1]].append((event["at"], event["attempt"]))
        return {kind: [attempt for _, attempt in sorted(found)] for kind, found in seen.items()}

    def _check(self) -> None:
        summary = self.workdir / "check.json"
        proc = spawn(prober_command(self.endpoints, "--mode", "check", "--from-events", str(self.events),
                                    "--subscription", self.subscription, "--lag", "0", "--idle-timeout", "15",
                                    "--max-examples", "50", "--summary", str(summary)),
                     self.logs / "check.log")
        proc.wait(self.plan.settle_timeout)
        verdict = parse_json_file(summary).get("verdict", {})
        violations = verdict.get("violations", {})
        self.figures["check"] = {"exit_status": proc.returncode, "summary": str(summary)}
        self.figures.update(
            published=sum(self.figures[phase]["publish"].get("published", 0) for phase in ("calm", "chaos")),
            expected=verdict.get("expected_messages"), delivered=verdict.get("deliveries"),
            first_deliveries=verdict.get("first_deliveries"), redelivered=verdict.get("redeliveries"),
            acked=verdict.get("acked_messages"), lost=verdict.get("lost_messages"),
            order_violations=sum(violations.get(k, 0) for k in ("gap", "reorder", "two_outstanding", "affinity")),
            cascade_violations=sum(violations.get(k, 0) for k in ("missing_cascade", "duplicate")),
            attempt_violations=violations.get("attempt", 0),
            stale_acks_accepted=violations.get("stale_ack", 0), acks_refused=verdict.get("ack_failures"),
            violations=violations, examples=verdict.get("examples", [])[:10],
            latency=verdict.get("latency"))
        attempts = self.figures["dead_letters"]["poison_attempts"]
        self.figures["poison_dead_lettered_exactly"] = sum(
            1 for kind in POISONS if attempts.get(kind) == self.plan.max_delivery_attempts)

    def _goals_met(self) -> bool:
        f = self.figures
        return bool(f["drained"] and f["uncommitted_after_drain"] == 0 and f["check"]["exit_status"] == 0
                    and f["lost"] == 0 and not f["violations"]
                    and f["expected"] == f["published"] and f["poison_dead_lettered_exactly"] == len(POISONS))


def report(figures: dict[str, Any]) -> str:
    """The figures as lines for a person."""
    calm, chaos = figures["calm"], figures["chaos"]
    lines = [
        f"soak {figures['plan']['name']}: {'OK' if figures['ok'] else 'FAILED'} in {figures['wall_seconds']} s "
        f"(evidence in {figures['workdir']})",
        f"messages published {figures['published']}, delivered {figures['delivered']} "
        f"(first deliveries {figures['first_deliveries']}, redelivered {figures['redelivered']}), "
        f"acked or dead-lettered {figures['acked']}, lost {figures['lost']}",
        f"in-key order violations {figures['order_violations']}, cascade violations {figures['cascade_violations']}, "
        f"attempt violations {figures['attempt_violations']}, stale acks accepted after fencing "
        f"{figures['stale_acks_accepted']} (acks refused {figures['acks_refused']})",
        f"poison messages dead-lettered after exactly {figures['plan']['max_delivery_attempts']} attempts: "
        f"{figures['poison_dead_lettered_exactly']} of {len(POISONS)} {figures['dead_letters']['poison_attempts']}; "
        f"deliveries seen {figures['poison_deliveries']}",
        f"throughput: calm {calm['throughput_per_s']} msg/s, during faults {chaos['throughput_per_s']} msg/s "
        f"(chaos publish rate {chaos['publish'].get('rate_per_s')} msg/s)",
        f"faults: {figures['subscriber_kills']} subscriber SIGKILLs, exits {figures['subscriber_exits']}, brokers "
        f"killed {chaos['brokers_killed']}, connections cut {figures.get('connections_cut')}",
        f"after the drain the committed offsets were {figures.get('uncommitted_after_drain')} behind the end offsets",
    ]
    return "\n".join(lines)


def run_soak(plan: SoakPlan, stack: LocalStack, workdir: Path) -> dict[str, Any]:
    """Run ``plan`` on ``stack`` (three brokers, running); return the figures."""
    return Soak(plan, stack, workdir).run()


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.soak [--short]``: a fresh three-broker stack in a temporary folder, the soak,
    its figures (lines, then JSON on stdout and in ``--out``). Exit status 1 when a goal was missed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="the two-minute plan")
    parser.add_argument("--workdir", type=Path, default=None, help="events and logs (default: a new temp folder)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON figures here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ol-soak-"))
    stack = LocalStack(workdir / "stack")
    try:
        stack.up(brokers=3)
        figures = run_soak(SHORT if args.short else FULL, stack, workdir)
    finally:
        stack.down()
    print(report(figures), file=sys.stderr)
    text = json.dumps(figures, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if figures["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
