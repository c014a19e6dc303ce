"""The prober's verifier on hand-made delivery streams: correct ones pass, broken ones are caught."""

from __future__ import annotations

import itertools
from typing import Any

from ordering_layer.prober.events import (
    ACK,
    ACK_FAILED,
    ACK_OK,
    NACK,
    DeadLettered,
    Delivery,
    Expectation,
    Fault,
    Lost,
    Settlement,
)
from ordering_layer.prober.verifier import Verifier


class Stream:
    """Builds events for a verifier: deliveries get increasing times and per-subscriber numbers."""

    def __init__(self, verifier: Verifier | None = None, run: str = "r") -> None:
        self.v = verifier or Verifier()
        self.run = run
        self._clock = itertools.count(1)
        self._numbers: dict[str, itertools.count[int]] = {}

    def deliver(self, seq: int, *, key: str = "k", sub: str = "s1", attempt: int = 1, batch: int | None = None,
                published_at: float | None = None) -> int:
        number = next(self._numbers.setdefault(sub, itertools.count(1)))
        self.v.feed(Delivery(float(next(self._clock)), sub, number, batch, key, self.run, seq, f"m{seq}", attempt,
                             published_at))
        return number

    def settle(self, outcome: str, seq: int, number: int, *, key: str = "k", sub: str = "s1", attempt: int = 1) -> None:
        self.v.feed(Settlement(float(next(self._clock)), sub, number, key, self.run, seq, attempt, outcome))

    def ack(self, seq: int, number: int, **kw: Any) -> None:
        self.settle(ACK, seq, number, **kw)

    def nack(self, seq: int, number: int, **kw: Any) -> None:
        self.settle(NACK, seq, number, **kw)

    def handle(self, seq: int, *, attempt: int = 1, outcome: str = ACK, **kw: Any) -> None:
        """Callback style: deliver one message and settle it."""
        number = self.deliver(seq, attempt=attempt, **kw)
        kw.pop("batch", None)
        kw.pop("published_at", None)
        self.settle(outcome, seq, number, attempt=attempt, **kw)

    def expect(self, count: int, key: str = "k") -> None:
        self.v.feed(Expectation(0.0, self.run, key, count))

    def finish(self) -> dict[str, Any]:
        return self.v.finish()


def kinds(verdict: dict[str, Any]) -> set[str]:
    return set(verdict["violations"])


# -- correct streams pass --------------------------------------------------------------------------
def test_callback_stream_with_nacks_passes() -> None:
    """SUB-1, SUB-4, ACK-6: one message at a time, a nack redelivers the same message with the next
    attempt, then the key goes on; everything acked."""
    s = Stream()
    s.expect(4)
    s.handle(0)
    s.handle(1, outcome=NACK)
    s.handle(1, attempt=2, outcome=NACK)
    s.handle(1, attempt=3)
    s.handle(2)
    s.handle(3)
    assert s.v.complete()
    verdict = s.finish()
    assert verdict["ok"], verdict["examples"]
    assert verdict["nacks"] == 2 and verdict["restarts"] == 2 and verdict["redeliveries"] == 2
    assert verdict["acked_messages"] == 4 and verdict["lost_messages"] == 0


def test_pull_batch_cascade_replays_acked_messages_and_passes() -> None:
    """SUB-1, SUB-4: a pull batch 0,1,2; 0 nacked, 1 and 2 acked; the redelivery batch replays 0,1,2
    (acked ones included). The old batch's acks may land after the redelivery: they are stale."""
    s = Stream()
    s.expect(4)
    d0, d1, d2 = (s.deliver(n, batch=1) for n in range(3))
    s.nack(0, d0)
    e0 = s.deliver(0, batch=2, attempt=2)
    s.ack(1, d1)
    s.ack(2, d2)
    e1, e2 = s.deliver(1, batch=2, attempt=2), s.deliver(2, batch=2, attempt=2)
    for seq, number in ((0, e0), (1, e1), (2, e2)):
        s.ack(seq, number, attempt=2)
    s.ack(3, s.deliver(3, batch=3))
    verdict = s.finish()
    assert verdict["ok"], verdict["examples"]
    assert verdict["redeliveries"] == 3 and verdict["stale_settlements"] == 2


def test_lost_subscriber_handover_may_redeliver_acked_messages() -> None:
    """SUB-3, SUB-5: a subscriber killed after acking (acks not yet durable) and holding one message;
    the new subscriber redelivers from an acked message, in order: a handover, not a violation."""
    s = Stream()
    s.expect(5)
    for n in range(3):
        s.handle(n, sub="a")
    s.deliver(3, sub="a")  # a is killed holding 3
    for n in range(1, 5):
        s.handle(n, sub="b", attempt=2 if n == 3 else 1)
    verdict = s.finish()
    assert verdict["ok"], verdict["examples"]
    assert verdict["handovers"] == 1 and verdict["redelivered_acked"] == 2


def test_fault_excuses_redelivery_of_acked_messages() -> None:
    """SUB-3/ACK-4: after a reported fault (Redis state lost) acked messages may come again, with
    attempts restarted; without the fault the same stream is a duplicate."""
    for fault in (True, False):
        s = Stream()
        s.expect(3)
        for n in range(3):
            s.handle(n)
        if fault:
            s.v.feed(Fault(10.0, "redis-flushall"))
        for n in range(3):
            s.handle(n)
        verdict = s.finish()
        assert verdict["ok"] is fault, verdict["examples"]
        if not fault:
            assert kinds(verdict) == {"duplicate", "attempt"}


def test_dead_lettered_message_counts_as_settled() -> None:
    """DLQ-2: a nack at attempt max_delivery_attempts dead-letters the message; the key goes on."""
    s = Stream(Verifier(max_delivery_attempts=5))
    s.expect(2)
    for attempt in range(1, 6):
        s.handle(0, attempt=attempt, outcome=NACK)
    s.handle(1)
    verdict = s.finish()
    assert verdict["ok"], verdict["examples"]
    assert verdict["dead_lettered"] == 1 and verdict["acked_messages"] == 2


def test_refused_ack_needs_a_redelivery() -> None:
    """SUB-3, ACK-5: an ack refused (lease lost) must be followed by a redelivery of the message."""
    s = Stream()
    s.expect(2)
    d0 = s.deliver(0)
    s.ack(0, d0)
    s.settle(ACK_FAILED, 0, d0)
    s.handle(0, attempt=2)
    s.handle(1)
    assert s.finish()["ok"]

    s = Stream()
    s.expect(2)
    d0 = s.deliver(0)
    s.ack(0, d0)
    s.settle(ACK_FAILED, 0, d0)
    s.handle(1)
    verdict = s.finish()
    assert kinds(verdict) == {"lost"} and verdict["lost_messages"] == 1


def test_lease_expiry_redelivers_the_unsettled_message() -> None:
    """ACK-1, SUB-4: a message whose lease lapsed while its handler ran comes again; the old
    handler's late ack is stale."""
    s = Stream()
    s.expect(2)
    d0 = s.deliver(0)
    d0b = s.deliver(0, attempt=2)
    s.ack(0, d0)
    s.ack(0, d0b, attempt=2)
    s.handle(1)
    verdict = s.finish()
    assert verdict["ok"], verdict["examples"]
    assert verdict["stale_settlements"] == 1


# -- broken streams are caught ---------------------------------------------------------------------
def test_detects_reorder() -> None:
    """SUB-1: 3 delivered before 2 (an injected swap) shows as a gap at 3 and a reorder at 2; the
    key keeps its position, so 4 is judged normally."""
    s = Stream()
    s.expect(5)
    for n in (0, 1, 3, 2, 4):
        s.handle(n)
    verdict = s.finish()
    assert verdict["violations"] == {"gap": 1, "reorder": 1}
    assert verdict["lost_messages"] == 0


def test_detects_gap() -> None:
    """SUB-1, SUB-3: 2 is never delivered: a gap when 3 comes, and 2 lost at the end."""
    s = Stream()
    s.expect(5)
    for n in (0, 1, 3, 4):
        s.handle(n)
    verdict = s.finish()
    assert verdict["violations"] == {"gap": 1, "lost": 1}
    assert verdict["lost_messages"] == 1
    assert {(e["kind"], e["seq"]) for e in verdict["examples"]} == {("gap", 3), ("lost", 2)}


def test_detects_gap_past_a_nacked_message() -> None:
    """SUB-1: after 1 is nacked the key goes on with 2 instead of redelivering 1."""
    s = Stream()
    s.handle(0)
    s.handle(1, outcome=NACK)
    s.handle(2)
    assert "gap" in kinds(s.finish())


def test_detects_duplicate() -> None:
    """SUB-4: a key whose messages were all acked is redelivered with no cause."""
    s = Stream()
    s.expect(4)
    for n in range(3):
        s.handle(n)
    s.handle(1, attempt=2)
    s.handle(2, attempt=2)
    s.handle(3)
    verdict = s.finish()
    assert verdict["violations"] == {"duplicate": 1}
    assert verdict["redelivered_acked"] == 2


def test_detects_missing_cascade() -> None:
    """SUB-4: 0 is redelivered but 1, delivered (and acked) before, is skipped."""
    s = Stream()
    s.expect(3)
    d0, d1, d2 = (s.deliver(n, batch=1) for n in range(3))
    s.nack(0, d0)
    s.ack(1, d1)
    s.ack(2, d2)
    e0 = s.deliver(0, batch=2, attempt=2)
    e2 = s.deliver(2, batch=2, attempt=2)
    s.ack(0, e0, attempt=2)
    s.ack(2, e2, attempt=2)
    assert s.finish()["violations"] == {"missing_cascade": 1}


def test_detects_cascade_that_never_finishes() -> None:
    """SUB-4: 0 is redelivered and acked, but 1 and 2 (delivered before) never come again."""
    s = Stream()
    s.expect(3)
    d0, d1, d2 = (s.deliver(n, batch=1) for n in range(3))
    s.nack(0, d0)
    s.ack(1, d1)
    s.ack(2, d2)
    s.ack(0, s.deliver(0, batch=2, attempt=2), attempt=2)
    assert not s.v.complete()
    assert s.finish()["violations"] == {"missing_cascade": 1}


def test_detects_two_outstanding_in_callback_mode() -> None:
    """SUB-1: callback mode: 1 delivered while 0 is not yet acked."""
    s = Stream()
    d0 = s.deliver(0)
    d1 = s.deliver(1)
    s.ack(0, d0)
    s.ack(1, d1)
    assert s.finish()["violations"] == {"two_outstanding": 1}


def test_detects_two_outstanding_batches_in_pull_mode() -> None:
    """SUB-1: pull mode: a second batch of the key while the first is unsettled."""
    s = Stream()
    first = [s.deliver(n, batch=1) for n in range(2)]
    second = s.deliver(2, batch=2)
    for n, number in enumerate([*first, second]):
        s.ack(n, number)
    assert s.finish()["violations"] == {"two_outstanding": 1}


def test_detects_affinity_violation() -> None:
    """SUB-5: the key's next message goes to another subscriber while the first holds one."""
    s = Stream()
    d0 = s.deliver(0, sub="a")
    d1 = s.deliver(1, sub="b")
    s.ack(0, d0, sub="a")
    s.ack(1, d1, sub="b")
    assert "affinity" in kinds(s.finish())


def test_detects_attempt_not_increasing() -> None:
    """ACK-6: a redelivery after a nack keeps its attempt; an attempt of 0."""
    s = Stream()
    s.handle(0, outcome=NACK)
    s.handle(0)
    s.handle(1, attempt=0)
    assert s.finish()["violations"] == {"attempt": 2}


def test_detects_lost_messages() -> None:
    """SUB-3: 5 published, 3 acked: 2 lost; and a delivered message never acked is lost too."""
    s = Stream()
    s.expect(5)
    for n in range(3):
        s.handle(n)
    s.deliver(0, key="other")
    verdict = s.finish()
    assert verdict["violations"] == {"lost": 2}
    assert verdict["lost_messages"] == 3


def test_violation_examples_are_bounded() -> None:
    """Bounded memory: 1,000 gaps are all counted, only max_examples are kept."""
    s = Stream(Verifier(max_examples=5))
    for n in range(0, 2000, 2):
        s.handle(n)
    verdict = s.v.finish()
    assert verdict["violations"]["gap"] == 999
    assert len([e for e in verdict["examples"] if e["kind"] == "gap"]) == 5


def test_state_is_per_key_not_per_message() -> None:
    """Bounded memory: 20,000 messages over 10 keys leave 10 fixed-size key states."""
    s = Stream()
    for n in range(2000):
        for key in range(10):
            s.handle(n, key=f"k{key}")
    assert len(s.v._keys) == 10
    assert all(not hasattr(state, "__dict__") for state in s.v._keys.values())
    assert s.finish()["ok"]


def test_latency_percentiles_and_unverified_records() -> None:
    """Latency runs from publish time to first delivery; records without prober metadata are
    counted as unverified and not judged."""
    v = Verifier()
    for n in range(100):
        v.feed(Delivery(1000.0 + n / 1000 + 0.001 * (n + 1), "s", n + 1, None, "k", "r", n, "m", 1,
                        1000.0 + n / 1000))
        v.feed(Settlement(1001.0 + n, "s", n + 1, "k", "r", n, 1, ACK))
    v.feed(Delivery(2000.0, "s", 101, None, "k", None, None, "foreign", 1, None))
    verdict = v.finish()
    assert verdict["ok"] and verdict["unverified"] == 1 and verdict["deliveries"] == 101
    latency = verdict["latency"]
    assert latency["count"] == 100
    assert 49 <= latency["p50_ms"] <= 52 and 98 <= latency["p99_ms"] <= 100.5 and latency["max_ms"] == 100.0


def test_replayed_message_nacked_again_restarts_there() -> None:
    """SUB-4: a cascade replays 1..3 (1 and 2 acked before); the replayed 2 is nacked: the next
    restart is at 2 although 2 had been acked in the first round; going back to 1 instead is a
    duplicate."""
    for restart, expected in ((2, {}), (1, {"duplicate": 1})):
        s = Stream()
        s.expect(4)
        d = [s.deliver(n, batch=1) for n in range(4)]
        s.ack(0, d[0])
        s.nack(1, d[1])
        s.ack(2, d[2])
        s.ack(3, d[3])
        e = {n: s.deliver(n, batch=2, attempt=2) for n in (1, 2, 3)}
        s.ack(1, e[1], attempt=2)
        s.nack(2, e[2], attempt=2)
        s.ack(3, e[3], attempt=2)
        f = {n: s.deliver(n, batch=3, attempt=3) for n in range(restart, 4)}
        for n, number in f.items():
            s.ack(n, number, attempt=3)
        verdict = s.finish()
        assert verdict["violations"] == expected, verdict["examples"]


def test_refused_ack_of_a_superseded_delivery_is_not_a_loss() -> None:
    """SUB-3: pull batches of one key overlap (the old batch's handler still acks while the cascade
    redelivers): a refused ack of 3 from the first round, reported after a later round covered 3
    and a further restart at 4, is no loss."""
    s = Stream()
    s.expect(5)
    first = {n: s.deliver(n, batch=1) for n in range(5)}
    s.nack(0, first[0])
    second = {n: s.deliver(n, batch=2, attempt=2) for n in range(5)}
    for n in range(4):
        s.ack(n, second[n], attempt=2)
    s.nack(4, second[4], attempt=2)
    s.ack(4, s.deliver(4, batch=3, attempt=3), attempt=3)
    s.settle(ACK_FAILED, 3, first[3])
    verdict = s.finish()
    assert verdict["ok"], verdict["examples"]


def test_fenced_ack_never_redelivered_is_a_loss() -> None:
    """SUB-3, ACK-5: subscriber a acks 0..2 but its ack of 2 is refused (fenced); the key moves on to
    b with 3: 2 was never redelivered, so it is lost although an ack was recorded."""
    s = Stream()
    s.expect(4)
    numbers = {}
    for n in range(3):
        numbers[n] = s.deliver(n, sub="a")
        s.ack(n, numbers[n], sub="a")
    s.handle(3, sub="b")
    s.settle(ACK_FAILED, 2, numbers[2], sub="a")
    verdict = s.finish()
    assert verdict["violations"] == {"lost": 1} and verdict["lost_messages"] == 1


# -- harness events: lost subscribers, dead letters found in the topic, confirmed acks ---------------
def test_key_moving_from_a_lost_holder_is_a_takeover_not_an_affinity_violation() -> None:
    """SUB-5, DLQ-2: subscriber a dies holding 1, whose crash redeliveries used up its attempts; b
    goes on with 2. Without the Lost event that is an affinity violation; with it a takeover, and
    the dead letter found in the topic settles 1 (nothing lost)."""
    for reported in (True, False):
        s = Stream()
        s.expect(3)
        s.handle(0, sub="a")
        s.deliver(1, sub="a", attempt=5)
        if reported:
            s.v.feed(Lost(50.0, "a"))
        s.handle(2, sub="b")
        s.v.feed(DeadLettered(60.0, "r", "k", 1, 5))
        verdict = s.finish()
        assert verdict["ok"] is reported, verdict["examples"]
        assert verdict["lost_messages"] == 0 and verdict["dead_letter_records"] == 1
        if reported:
            assert verdict["takeovers"] == 1 and verdict["subscribers_lost"] == 1
        else:
            assert kinds(verdict) == {"affinity"}


def test_message_never_acked_nor_dead_lettered_is_lost_even_after_a_takeover() -> None:
    """SUB-3: the holder died holding 1 and the key went on with 2, but 1 is not in the dead-letter
    topic: 1 is lost."""
    s = Stream()
    s.expect(3)
    s.handle(0, sub="a")
    s.deliver(1, sub="a")
    s.v.feed(Lost(50.0, "a"))
    s.handle(2, sub="b")
    verdict = s.finish()
    assert kinds(verdict) == {"lost"} and verdict["lost_messages"] == 1


def test_stale_ack_that_took_effect_is_a_fencing_violation() -> None:
    """ACK-5: a sends its ack of 0 after b delivered 0 (b owns the partition now). Refused
    (ack_failed): fine. SUCCESS (ack_ok): a stale ack was accepted. An ack_ok of a current delivery
    is no violation."""
    for outcome in (ACK_FAILED, ACK_OK):
        s = Stream()
        s.expect(2)
        old = s.deliver(0, sub="a")
        s.handle(0, sub="b", attempt=2)
        s.ack(0, old, sub="a")
        s.settle(outcome, 0, old, sub="a")
        number = s.deliver(1, sub="b")
        s.ack(1, number, sub="b")
        s.settle(ACK_OK, 1, number, sub="b")
        verdict = s.finish()
        assert verdict["ok"] is (outcome == ACK_FAILED), verdict["examples"]
        assert verdict["stale_settlements"] == 1
        if outcome == ACK_OK:
            assert kinds(verdict) == {"stale_ack"} and verdict["examples"][0]["property"] == "ACK-5"
            assert verdict["acks_confirmed"] == 2


def test_fault_during_a_run_excuses_attempts_restarting_at_its_start() -> None:
    """ACK-6 after a fault: a run that began before a Redis FLUSHALL may be replayed from its start
    with attempts counted again from 1, even when the key had deliveries after the fault; without the
    fault the same stream breaks ACK-6."""
    for fault in (True, False):
        s = Stream()
        s.expect(3)
        s.handle(0, outcome=NACK)
        s.handle(0, attempt=2)
        s.handle(1)
        if fault:
            s.v.feed(Fault(10.0, "redis-flushall"))
        s.handle(2)
        for n in range(3):
            s.handle(n, sub="s2")
        verdict = s.finish()
        if fault:
            assert verdict["ok"], verdict["examples"]
        else:
            assert "attempt" in kinds(verdict)
