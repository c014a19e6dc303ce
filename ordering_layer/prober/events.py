"""What the prober's verifier is fed: deliveries, settlements, faults and expectations.

These typed, immutable events are also the prober's event stream between processes: each becomes
one JSON object per line (``to_json`` / ``from_json``), so several subscriber processes can append
their deliveries to files that one checker reads (see ``ordering_layer.prober.eventlog``).

The prober's own metadata travels in a message's attributes (Kafka headers), not in its payload,
so records written by any producer that sets these headers can be checked too:

* ``prober-run``: the run id (sequence numbers restart at 0 in each run);
* ``prober-seq``: the message's number within its ordering key and run (0, 1, 2, ...);
* ``prober-published``: publish time, seconds since the epoch (for end-to-end latency);
* ``prober-poison``: a poison message (``nack``: nacked on every delivery; ``exit``: its handler
  ends the subscriber process with ``os._exit`` on every delivery; ``hold``: its handler holds it
  past its lease, then acks). Poison messages carry no run or seq: they are not judged, a harness
  checks that they reach the dead-letter topic (DLQ-2, DLQ-3).

A record without ``prober-run`` and ``prober-seq`` cannot have its per-key order judged (its
place in its key's sequence is unknown; offsets of one key are not consecutive), so it is counted
as unverified.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NamedTuple

from ordering_layer.errors import ConfigError

ATTR_RUN = "prober-run"
ATTR_SEQ = "prober-seq"
ATTR_PUBLISHED = "prober-published"
ATTR_POISON = "prober-poison"

POISON_NACK = "nack"
POISON_EXIT = "exit"
POISON_HOLD = "hold"
POISONS = (POISON_NACK, POISON_EXIT, POISON_HOLD)

ACK = "ack"
NACK = "nack"
ACK_FAILED = "ack_failed"  # an ack was refused (lease lost or expired): the message must come again
ACK_OK = "ack_ok"  # an ack's response was SUCCESS: it took effect
OUTCOMES = (ACK, NACK, ACK_FAILED, ACK_OK)


class ProbeFields(NamedTuple):
    """The prober metadata of one message, read from its attributes."""

    run: str
    seq: int
    published_at: float | None


def probe_fields(attributes: Mapping[str, str]) -> ProbeFields | None:
    """The prober metadata in ``attributes``, or None when the record does not carry it (or it is malformed)."""
    run = attributes.get(ATTR_RUN)
    raw_seq = attributes.get(ATTR_SEQ)
    if run is None or raw_seq is None:
        return None
    try:
        seq = int(raw_seq)
    except ValueError:
        return None
    if seq < 0:
        return None
    raw_published = attributes.get(ATTR_PUBLISHED)
    try:
        published = float(raw_published) if raw_published is not None else None
    except ValueError:
        published = None
    return ProbeFields(run, seq, published)


class Delivery(NamedTuple):
    """One hand-off of a message to the prober's handler.

    ``delivery`` numbers the deliveries of one subscriber (1, 2, ...); ``batch`` names the pull
    batch it came in (None in callback mode, where every delivery stands alone). ``run`` and
    ``seq`` are None for a record without prober metadata (unverified).
    """

    at: float
    subscriber: str
    delivery: int
    batch: int | None
    key: str
    run: str | None
    seq: int | None
    message_id: str
    attempt: int
    published_at: float | None


class Settlement(NamedTuple):
    """What the handler did with a delivery: ``ack`` or ``nack`` (written before the call, so that
    it precedes the key's next delivery), then ``ack_ok`` or ``ack_failed`` when the ack's response
    comes (SUCCESS or not)."""

    at: float
    subscriber: str
    delivery: int
    key: str
    run: str | None
    seq: int | None
    attempt: int
    outcome: str


class Fault(NamedTuple):
    """A fault injected by a harness (Redis flushed, broker restarted, ...): from here on, already
    acked messages may legitimately come again, and attempt counts may restart."""

    at: float
    what: str


class Lost(NamedTuple):
    """A harness's word that a subscriber process died at ``at`` (killed, or crashed): what it held
    unsettled is not settled by it; another subscriber may take its keys at once."""

    at: float
    subscriber: str


class DeadLettered(NamedTuple):
    """A message found in the subscription's dead-letter topic: settled (DLQ-2), not lost."""

    at: float
    run: str
    key: str
    seq: int
    attempts: int


class Expectation(NamedTuple):
    """The publisher's final word on a key: ``messages`` messages (seq 0..messages-1) were published."""

    at: float
    run: str
    key: str
    messages: int


Event = Delivery | Settlement | Fault | Expectation | Lost | DeadLettered

_TYPES: dict[str, type[Any]] = {"delivery": Delivery, "settle": Settlement, "fault": Fault, "expect": Expectation,
                                "lost": Lost, "dead": DeadLettered}
_NAMES = {cls: name for name, cls in _TYPES.items()}


def to_json(event: Event) -> str:
    """One JSON line (without the newline) for ``event``."""
    body = event._asdict()
    body["ev"] = _NAMES[type(event)]
    return json.dumps(body, separators=(",", ":"))


def from_json(line: str) -> Event:
    """The event written by ``to_json``.

    Raises:
        ConfigError: the line is not JSON, names no known event type, or lacks a field.
    """
    try:
        body = json.loads(line)
        cls = _TYPES[body.pop("ev")]
        event: Event = cls(**body)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"not a prober event: {line[:200]!r} ({exc})") from exc
    if isinstance(event, Settlement) and event.outcome not in OUTCOMES:
        raise ConfigError(f"unknown settlement outcome {event.outcome!r}")
    return event
