"""The prober's verifier: judges deliveries and settlements online, in O(1) memory per key.

Pure logic, no I/O, not thread-safe (the caller serialises). Events must come in causal order per
key: a handler's ack or nack is recorded before it is sent, so it precedes the key's next delivery.

Per key (a run id and an ordering key) it keeps: ``last`` (seq of the last delivery), ``high``
(highest seq delivered), ``acked`` (every seq <= acked was acked or dead-lettered) plus one range
of acks beyond it, the current *run* (deliveries since the last step back or change of subscriber:
its first seq and delivery number, holder, batch, unsettled count, and ``run_acked``: how far it was
acked in order), the first seq and delivery of the last 8 runs, the lowest nacked seq not
redelivered yet, the lowest seq whose ack was refused with no later delivery of it, and the fault
generation it last saw. Settlements of a key are expected in delivery order.

A delivery of seq n with ``n > last`` goes forward; with ``n <= last`` it steps back (a restart).
A restart has a *cause* when the key has a nack not yet redelivered or an unsettled delivery (lease
expiry); it is *excused* when it goes to a new subscriber (the holder was lost), a fault was
reported since the key's last delivery, or an ack at or above n was refused: then acks recorded
may not have been durable. A caused restart must come back to ``run_acked + 1``, the lowest
message not acked in the run. Violations (each names its property):

* ``two_outstanding`` (SUB-1): a forward delivery while the key has an unsettled delivery from
  another batch (callback mode: any unsettled delivery); ``affinity`` (SUB-5) when it goes to
  another subscriber than the one holding it, unless a ``Lost`` event said the holder died.
* ``gap`` (SUB-1): a delivery that skips a message not acked: forward past never-delivered
  messages (``n > high + 1``), forward past a nacked message, or a restart above ``run_acked + 1``.
* ``missing_cascade`` (SUB-4): after a restart at m, a forward delivery that skips one of the
  already-delivered m+1..high (or, at the end, a cascade that never reached ``high``).
* ``reorder`` (SUB-1): a step back with neither cause nor excuse to a message never acked: it
  arrives after a later one. The key keeps its position. An injected swap of n and n+1 shows as a
  gap and a reorder.
* ``duplicate`` (SUB-4): a step back without cause or excuse to an acked message, or a caused
  restart that goes back further than ``run_acked + 1`` without excuse.
* ``attempt`` (ACK-6): an attempt below 1, or the redelivery of the key's last (or run-starting)
  message with an attempt not above its previous one (excused after a fault). Attempts of
  messages replayed in a cascade are not compared (no per-message memory).
* ``lost`` (SUB-3, at ``finish``): an expected message never acked nor dead-lettered, or a refused
  ack never followed by a redelivery; ``unpublished``: a seq beyond the expected count.

* ``stale_ack`` (ACK-5): an ack sent after another subscriber had delivered the key (so had taken
  its partition over) whose response was SUCCESS (``ack_ok``): fencing let an old owner's ack in.

A nack at attempt ``max_delivery_attempts`` counts as dead-lettered (DLQ-2), i.e. settled, and so
does a message a ``DeadLettered`` event names (found in the dead-letter topic, for example after
crash redeliveries used up its attempts).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from ordering_layer.prober.events import (
    ACK,
    ACK_FAILED,
    ACK_OK,
    DeadLettered,
    Delivery,
    Event,
    Expectation,
    Fault,
    Lost,
    Settlement,
)
from ordering_layer.prober.latency import LatencyHistogram

_RUNS_KEPT = 8

PROPERTIES = {"two_outstanding": "SUB-1", "affinity": "SUB-5", "gap": "SUB-1", "missing_cascade": "SUB-4",
              "reorder": "SUB-1", "duplicate": "SUB-4", "attempt": "ACK-6", "lost": "SUB-3",
              "unpublished": "SUB-3", "stale_ack": "ACK-5"}


@dataclass(frozen=True)
class Violation:
    """One example of a broken property."""

    kind: str
    run: str
    key: str
    seq: int
    subscriber: str
    at: float
    detail: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, with the property id."""
        return {"kind": self.kind, "property": PROPERTIES[self.kind], "run": self.run, "key": self.key,
                "seq": self.seq, "subscriber": self.subscriber, "at": self.at, "detail": self.detail}


class _Key:
    __slots__ = ("acked", "ahead_hi", "ahead_lo", "batch", "expected", "gen", "high", "holder", "last",
                 "last_attempt", "nacked", "owed", "run_acked", "run_attempt", "run_first", "run_gen",
                 "run_start", "runs", "unsettled")

    def __init__(self, gen: int) -> None:
        self.last = self.high = self.acked = -1
        self.ahead_lo = self.ahead_hi = -1  # one range of acks beyond ``acked`` (empty when lo < 0)
        self.run_start = self.run_first = self.run_attempt = self.last_attempt = 0
        self.run_acked = -1
        self.holder = ""
        self.batch: int | None = None
        self.unsettled = 0
        self.nacked: int | None = None
        self.owed: int | None = None
        # The last few runs (subscriber, first delivery number, first seq): judge refused acks by.
        self.runs: deque[tuple[str, int, int]] = deque(maxlen=_RUNS_KEPT)
        self.gen = gen
        self.run_gen = gen  # the fault generation the current run started in
        self.expected: int | None = None


class Verifier:
    """Feed it events (``feed``), read progress (``counters``), and get the verdict (``finish``).

    Args:
        max_delivery_attempts: the subscription's dead-letter limit, or None without dead-lettering.
        max_examples: violations kept per kind (all are counted).
    """

    def __init__(self, *, max_delivery_attempts: int | None = None, max_examples: int = 20) -> None:
        self.max_delivery_attempts = max_delivery_attempts
        self.max_examples = max_examples
        self.latency = LatencyHistogram()
        self.violations: dict[str, int] = {}
        self.examples: list[Violation] = []
        self.counts = dict.fromkeys(("deliveries", "first_deliveries", "redeliveries", "redelivered_acked",
                                     "restarts", "handovers", "acks", "nacks", "ack_failures", "dead_lettered",
                                     "ack_failures_unjudged", "stale_settlements", "unverified", "faults",
                                     "acked_messages", "acks_confirmed", "subscribers_lost", "takeovers",
                                     "dead_letter_records"), 0)
        self._keys: dict[tuple[str, str], _Key] = {}
        self._gen = 0
        self._per_kind: dict[str, int] = {}
        self._lost: set[str] = set()
        # Acks sent for a delivery another subscriber had taken over, awaiting their response.
        self._stale_acks: dict[tuple[str, int], Settlement] = {}

    def feed(self, event: Event) -> None:
        """Judge one event."""
        if isinstance(event, Delivery):
            self._delivered(event)
        elif isinstance(event, Settlement):
            self._settled(event)
        elif isinstance(event, Fault):
            self._gen += 1
            self.counts["faults"] += 1
        elif isinstance(event, Lost):
            self._lost.add(event.subscriber)
            self.counts["subscribers_lost"] += 1
        elif isinstance(event, DeadLettered):
            self._dead_lettered(event)
        else:
            self._expect(event)

    def _key(self, run: str, key: str) -> _Key:
        state = self._keys.get((run, key))
        if state is None:
            state = self._keys[(run, key)] = _Key(self._gen)
        return state

    def _expect(self, event: Expectation) -> None:
        state = self._key(event.run, event.key)
        state.expected = max(state.expected or 0, event.messages)

    def _violate(self, kind: str, d: Delivery, seq: int, detail: str) -> None:
        self._record(Violation(kind, d.run or "", d.key, seq, d.subscriber, d.at, detail))

    def _record(self, violation: Violation) -> None:
        kind = violation.kind
        self.violations[kind] = self.violations.get(kind, 0) + 1
        kept = self._per_kind.get(kind, 0)
        if kept < self.max_examples:
            self._per_kind[kind] = kept + 1
            self.examples.append(violation)

    # -- deliveries --------------------------------------------------------------------------------
    def _delivered(self, d: Delivery) -> None:
        counts = self.counts
        counts["deliveries"] += 1
        if d.run is None or d.seq is None:
            counts["unverified"] += 1
            return
        k = self._key(d.run, d.key)
        n = d.seq
        if d.attempt < 1:
            self._violate("attempt", d, n, f"delivery attempt {d.attempt} < 1")
        if n > k.last:
            self._forward(k, d, n)
        elif not self._restart(k, d, n):
            return  # a stray (reordered) delivery: the key keeps its position
        if n > k.high:
            counts["first_deliveries"] += 1
            k.high = n
            if d.published_at is not None:
                self.latency.add(d.at - d.published_at)
        else:
            counts["redeliveries"] += 1
        if n <= k.acked:
            counts["redelivered_acked"] += 1
        k.last, k.last_attempt, k.batch, k.gen = n, d.attempt, d.batch, self._gen

    def _forward(self, k: _Key, d: Delivery, n: int) -> None:
        if k.unsettled and not (d.batch is not None and d.batch == k.batch and d.subscriber == k.holder):
            if k.holder in self._lost:
                self.counts["takeovers"] += 1  # its holder died: SUB-5 lets the key move
            elif d.subscriber != k.holder:
                self._violate("affinity", d, n, f"delivered to {d.subscriber} while {k.holder} holds "
                                                f"{k.unsettled} unsettled message(s) up to {k.last}")
            else:
                self._violate("two_outstanding", d, n, f"delivered while {k.unsettled} message(s) up to "
                                                       f"{k.last} are unsettled (another batch)")
        if n > k.last + 1:
            if k.last < k.high:
                self._violate("missing_cascade", d, n, f"cascade skipped {k.last + 1}..{min(n - 1, k.high)}, "
                                                       f"delivered before up to {k.high}")
            else:
                self._violate("gap", d, n, f"skipped {k.high + 1}..{n - 1}, never delivered")
        elif k.nacked is not None:
            self._violate("gap", d, n, f"went on past nacked {k.nacked} without redelivering it")
            k.nacked = None
        if d.subscriber != k.holder:
            self._new_run(k, d, n)
        else:
            k.unsettled += 1

    def _restart(self, k: _Key, d: Delivery, n: int) -> bool:
        """Judge a step back; returns False for a stray delivery that leaves the key's position."""
        handover = d.subscriber != k.holder
        fault = k.gen != self._gen
        failed_ack = k.owed is not None and n <= k.owed
        excused = handover or fault or failed_ack
        pending = k.run_acked + 1  # the current run's lowest message not acked in it: where SUB-4 restarts
        if not (excused or k.nacked is not None or k.unsettled > 0):
            if n > k.acked:
                self._violate("reorder", d, n, f"came after {k.last} with no nack, expiry or fault to explain it")
                k.unsettled += 1
                return False
            self._violate("duplicate", d, n, f"acked {n} redelivered with nothing nacked or outstanding "
                                             f"and no fault or lost subscriber")
        elif n > pending:
            self._violate("gap", d, n, f"redelivery restarted at {n}, skipping {pending}..{n - 1} (nacked or "
                                       f"unsettled)")
        elif n < pending and not excused:
            self._violate("duplicate", d, n, f"redelivery went back to {n}, before {pending} (acked in this run, "
                                             f"no fault or lost subscriber)")
        if not fault and n == k.last and d.attempt <= k.last_attempt:
            self._violate("attempt", d, n, f"redelivered with attempt {d.attempt}, was {k.last_attempt}")
        elif k.run_gen == self._gen and n == k.run_start and n != k.last and d.attempt <= k.run_attempt:
            self._violate("attempt", d, n, f"redelivered with attempt {d.attempt}, was {k.run_attempt}")
        self.counts["restarts"] += 1
        if handover:
            self.counts["handovers"] += 1
        if failed_ack:
            k.owed = None
        k.nacked = None
        self._new_run(k, d, n)
        return True

    def _new_run(self, k: _Key, d: Delivery, n: int) -> None:
        k.run_gen = self._gen
        k.holder, k.run_start, k.run_first, k.run_attempt, k.unsettled = d.subscriber, n, d.delivery, d.attempt, 1
        k.run_acked = n - 1
        k.runs.append((d.subscriber, d.delivery, n))

    # -- settlements -------------------------------------------------------------------------------
    def _settled(self, s: Settlement) -> None:
        if s.run is None or s.seq is None:
            return
        k = self._keys.get((s.run, s.key))
        n = s.seq
        current = k is not None and s.subscriber == k.holder and s.delivery >= k.run_first
        if s.outcome == ACK_OK:
            self.counts["acks_confirmed"] += 1
            stale = self._stale_acks.pop((s.subscriber, s.delivery), None)
            if stale is not None:
                self._record(Violation("stale_ack", s.run, s.key, n, s.subscriber, stale.at,
                                       f"ack sent after {k.holder if k else '?'} took the key over took effect"))
            return
        if s.outcome == ACK_FAILED:
            self.counts["ack_failures"] += 1
            self._stale_acks.pop((s.subscriber, s.delivery), None)
            if k is not None and not self._redelivered_since(k, s):
                k.owed = n if k.owed is None else min(k.owed, n)
            return
        if k is None or not current:
            self.counts["stale_settlements"] += 1
            if k is not None and s.outcome == ACK and s.subscriber != k.holder:
                # Sent after another subscriber delivered the key, so after it took the partition
                # over: fencing (ACK-5) must refuse it.
                self._stale_acks[(s.subscriber, s.delivery)] = s
            return
        k.unsettled = max(0, k.unsettled - 1)
        if s.outcome == ACK:
            self.counts["acks"] += 1
            if n == k.run_acked + 1:
                k.run_acked = n
            self._ack(k, n)
            return
        self.counts["nacks"] += 1
        if self.max_delivery_attempts is not None and s.attempt >= self.max_delivery_attempts:
            self.counts["dead_lettered"] += 1
            if n == k.run_acked + 1:
                k.run_acked = n
            self._ack(k, n)
        else:
            k.nacked = n if k.nacked is None else min(k.nacked, n)

    def _dead_lettered(self, e: DeadLettered) -> None:
        """A message the dead-letter topic holds counts as settled (DLQ-2), whenever it is reported."""
        k = self._key(e.run, e.key)
        self.counts["dead_letter_records"] += 1
        if k.owed == e.seq:
            k.owed = None
        if k.nacked == e.seq:
            k.nacked = None
        self._ack(k, e.seq)

    def _redelivered_since(self, k: _Key, s: Settlement) -> bool:
        """Whether a run that began after the settled delivery covers its message: then the refused
        ack was of a superseded delivery. Unknown (the delivery is older than the runs kept) counts
        as covered."""
        lowest = s.seq if s.seq is not None else 0
        since = None
        for subscriber, first, start in reversed(k.runs):
            if subscriber == s.subscriber and first <= s.delivery:
                return since is not None and since <= lowest
            since = start if since is None else min(since, start)
        self.counts["ack_failures_unjudged"] += 1
        return True

    def _ack(self, k: _Key, n: int) -> None:
        before = k.acked
        if n == k.acked + 1:
            k.acked = n
            if k.ahead_lo >= 0 and k.ahead_lo <= n + 1:
                k.acked = max(n, k.ahead_hi)
                k.ahead_lo = k.ahead_hi = -1
        elif n > k.acked + 1:
            if k.ahead_lo >= 0 and k.ahead_lo <= n <= k.ahead_hi + 1:
                k.ahead_hi = max(k.ahead_hi, n)
            else:
                k.ahead_lo = k.ahead_hi = n
        self.counts["acked_messages"] += k.acked - before

    # -- progress and verdict ----------------------------------------------------------------------
    def violation_count(self) -> int:
        """Violations so far (all kinds)."""
        return sum(self.violations.values())

    def expected_total(self) -> int:
        """Messages the publishers declared."""
        return sum(k.expected or 0 for k in self._keys.values())

    def complete(self) -> bool:
        """True when every key seen is settled: all expected (or else all delivered) messages acked,
        nothing unsettled, no cascade or redelivery pending."""
        for k in self._keys.values():
            target = k.expected - 1 if k.expected is not None else k.high
            if k.acked < target or k.unsettled or k.last < k.high or k.nacked is not None or k.owed is not None:
                return False
        return bool(self._keys)

    def finish(self) -> dict[str, Any]:
        """Judge what never came (SUB-3, pending cascades) and return the verdict as a dict.

        Call it once, after the last event."""
        lost_messages = sum(self._judge_end(run, key, k) for (run, key), k in self._keys.items())
        return {"ok": not self.violations, "violations": dict(sorted(self.violations.items())),
                "keys": len(self._keys), "expected_messages": self.expected_total(), "lost_messages": lost_messages,
                **self.counts, "latency": self.latency.summary(),
                "examples": [v.to_dict() for v in self.examples]}

    def _judge_end(self, run: str, key: str, k: _Key) -> int:
        """Record the end-of-run violations of one key; return its lost messages."""
        def lapse(kind: str, seq: int, detail: str) -> None:
            self._record(Violation(kind, run, key, seq, k.holder, 0.0, detail))

        target = k.expected if k.expected is not None else k.high + 1
        missing = target - (k.acked + 1)
        if k.ahead_lo >= 0 and k.ahead_lo < target:
            missing -= min(k.ahead_hi, target - 1) - k.ahead_lo + 1
        lost = max(0, missing)
        if missing > 0:
            lapse("lost", k.acked + 1, f"{missing} of {k.acked + 1}..{target - 1} never acked")
        if k.owed is not None:
            lost += 1
            lapse("lost", k.owed, "ack refused and never redelivered")
        if k.last < k.high:
            lapse("missing_cascade", k.last + 1, f"cascade stopped at {k.last}, delivered before up to {k.high}")
        if k.expected is not None and k.high >= k.expected:
            lapse("unpublished", k.high, f"seq {k.high} delivered, {k.expected} published")
        return lost
