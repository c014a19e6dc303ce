"""The prober's publishing side: numbered per-key sequences through ``OrderedProducer.publish``.

Message ``seq`` of key K carries its run id, ``seq`` and publish time in its attributes (see
``ordering_layer.prober.events``); the payload is filler of the configured size. Keys take turns
(round robin), paced to ``rate`` messages per second. When a publish of K fails, K is paused by the
producer (PUB-2) together with its queued messages: once K's in-flight publishes have all
resolved, the prober resumes K and publishes again from the first failed ``seq``, so each key's
published sequence stays 0, 1, 2, ... without holes.

Poison messages (``poison``: kinds of ``ordering_layer.prober.events.POISONS``) are published first,
one per kind on its own key ``<key_prefix>-poison-<kind>``, without run or seq.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from ordering_layer.errors import ConfigError, OrderingKeyPausedError, PublishError
from ordering_layer.prober.events import ATTR_POISON, ATTR_PUBLISHED, ATTR_RUN, ATTR_SEQ, POISONS
from ordering_layer.publisher import OrderedProducer

_LOGGER = logging.getLogger(__name__)

_RETRY_FOR = 60.0  # seconds spent after the plan ends republishing keys whose publishes failed


@dataclass(frozen=True)
class PublishPlan:
    """What to publish.

    Attributes:
        topic: the topic; None: ``prober-<run id>`` (``topic_name``).
        run_id: the run's id (sequence numbers restart at 0 in each run); default: random.
        keys: how many ordering keys (``<key_prefix>-0`` ...).
        messages: messages in all, spread evenly over the keys; 0 = no limit (use ``duration``).
        duration: seconds of publishing; 0 = no limit (use ``messages``).
        rate: messages per second over all keys; 0 = as fast as the producer takes them.
        payload_size: bytes of filler payload per message.
        poison: kinds of poison message to publish first, one each.
    """

    topic: str | None = None
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    keys: int = 100
    key_prefix: str = "key"
    messages: int = 10_000
    duration: float = 0.0
    rate: float = 0.0
    payload_size: int = 100
    poison: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = sorted(set(self.poison) - set(POISONS))
        if unknown:
            raise ConfigError(f"unknown poison kind(s) {unknown}; known: {list(POISONS)}")

    @property
    def topic_name(self) -> str:
        """The topic (default ``prober-<run id>``)."""
        return self.topic or f"prober-{self.run_id}"

    def poison_keys(self) -> dict[str, str]:
        """The ordering key of each poison kind to publish."""
        return {kind: f"{self.key_prefix}-poison-{kind}" for kind in self.poison}

    def key_names(self) -> list[str]:
        """The ordering keys, in turn order."""
        return [f"{self.key_prefix}-{i}" for i in range(self.keys)]

    def quota(self, index: int) -> float:
        """Messages for key number ``index`` (infinite without a message count)."""
        if not self.messages:
            return float("inf")
        return self.messages // self.keys + (1 if index < self.messages % self.keys else 0)


class ProbePublisher:
    """Publishes a ``PublishPlan`` with ``producer`` when ``run()`` is called (blocks until done).

    ``published`` and ``failures`` count as publishes resolve; ``expectations()`` gives each key's
    final message count once ``run()`` returned. Setting ``stop`` ends publishing early (what was
    published so far is still counted exactly).
    """

    def __init__(self, producer: OrderedProducer, plan: PublishPlan, stop: threading.Event | None = None) -> None:
        self.plan = plan
        self.stop = stop or threading.Event()
        self.published = 0
        self.failures = 0
        self.started = 0.0
        self.finished = 0.0
        self.poison_published = 0
        self._producer = producer
        self._keys = plan.key_names()
        self._next = dict.fromkeys(self._keys, 0)
        self._in_flight = dict.fromkeys(self._keys, 0)
        self._failed: dict[str, int] = {}
        self._payload = b"p" * plan.payload_size
        self._lock = threading.Lock()
        self._resolved = threading.Condition(self._lock)

    def run(self) -> None:
        """Publish the plan, wait for every publish to resolve, republish failed keys (up to a minute)."""
        plan = self.plan
        self._publish_poison()
        self.started = time.monotonic()
        deadline = self.started + plan.duration if plan.duration else float("inf")
        sent = 0
        while not self.stop.is_set() and time.monotonic() < deadline:
            progressed, remaining = self._round(sent)
            sent += progressed
            if not remaining:
                break
            if not progressed:
                with self._resolved:
                    self._resolved.wait(0.05)
        self._producer.flush(30)
        retry_until = time.monotonic() + _RETRY_FOR
        while self._failed and not self.stop.is_set() and time.monotonic() < retry_until and \
                (plan.messages or time.monotonic() < deadline):
            progressed, _ = self._round(sent)
            sent += progressed
            self._producer.flush(1)
        self._producer.flush(30)
        self.finished = time.monotonic()

    def _publish_poison(self) -> None:
        """Publish one message per poison kind, each retried a few times (a broker may be down)."""
        for kind, key in self.plan.poison_keys().items():
            for attempt in range(1, 4):
                try:
                    self._producer.publish(self.plan.topic_name, self._payload, ordering_key=key,
                                           attributes={ATTR_POISON: kind}).result(timeout=60)
                except (PublishError, TimeoutError) as exc:
                    _LOGGER.warning("poison %s: publish attempt %d failed (%s)", kind, attempt, exc)
                    self._producer.resume_publish(key)
                    continue
                self.poison_published += 1
                break

    def _round(self, sent: int) -> tuple[int, bool]:
        """One turn over the keys; returns (messages sent, whether any key has more to send)."""
        plan = self.plan
        progressed = 0
        remaining = False
        for index, key in enumerate(self._keys):
            if self.stop.is_set():
                break
            with self._lock:
                if key in self._failed:
                    if self._in_flight[key]:
                        remaining = True
                        continue
                    self._next[key] = self._failed.pop(key)
                    self._producer.resume_publish(key)
                seq = self._next[key]
            if seq >= plan.quota(index):
                continue
            remaining = True
            if plan.rate:
                wait = self.started + (sent + progressed) / plan.rate - time.monotonic()
                if wait > 0 and self.stop.wait(wait):
                    break
            self._publish(key, seq)
            progressed += 1
        return progressed, remaining

    def _publish(self, key: str, seq: int) -> None:
        attributes = {ATTR_RUN: self.plan.run_id, ATTR_SEQ: str(seq), ATTR_PUBLISHED: f"{time.time():.6f}"}
        with self._lock:
            self._next[key] = seq + 1
            self._in_flight[key] += 1
        try:
            future = self._producer.publish(self.plan.topic_name, self._payload, ordering_key=key,
                                            attributes=attributes)
        except OrderingKeyPausedError as exc:
            self._resolve(key, seq, exc)
            return
        future.add_done_callback(lambda f: self._resolve(key, seq, f.exception()))

    def _resolve(self, key: str, seq: int, error: BaseException | None) -> None:
        with self._resolved:
            self._in_flight[key] -= 1
            if error is None:
                self.published += 1
            else:
                self.failures += 1
                if seq < self._failed.get(key, seq + 1):
                    _LOGGER.warning("publish of %s #%d failed (%s); will republish from there", key, seq, error)
                    self._failed[key] = seq
            self._resolved.notify_all()

    def in_flight(self) -> int:
        """Publishes not resolved yet."""
        with self._lock:
            return sum(self._in_flight.values())

    def expectations(self) -> dict[str, int]:
        """Each key's published count: seq 0..count-1 were published (a key still failing at the
        end counts up to its first failed seq)."""
        with self._lock:
            return {key: self._failed.get(key, self._next[key]) for key in self._keys}

