"""One prober run: publish, consume and verify in the combination the mode asks for.

Modes:

* ``full``: publish a plan, consume it, verify online (one process).
* ``publish``: publish only; the summary (and, with an events folder, ``Expectation`` lines in
  ``publisher-<run>.jsonl``) gives each key's count for a later check.
* ``consume``: consume and append every delivery and settlement to ``<events>/<subscriber>.jsonl``,
  without judging: one of several subscriber processes that a checker verifies together.
* ``check``: verify records another process published: by consuming the subscription here, or,
  with ``from_events``, by reading the events folder the ``consume`` processes write. Expected
  counts come from ``expect`` (a publish summary) or from ``Expectation`` lines; without them a
  key is judged up to the highest seq seen, and the check ends when idle.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ordering_layer.admin import Admin
from ordering_layer.config import DeadLetterPolicy, FlowControl, RetryPolicy, SubscriptionSettings
from ordering_layer.errors import SubscriptionNotFoundError
from ordering_layer.prober.consumer import ProbeConsumer
from ordering_layer.prober.eventlog import EventFolderReader, EventLog
from ordering_layer.prober.events import Event, Expectation
from ordering_layer.prober.options import ProbeOptions
from ordering_layer.prober.publisher import ProbePublisher
from ordering_layer.prober.verifier import Verifier
from ordering_layer.publisher import OrderedProducer

_LOGGER = logging.getLogger(__name__)

_TICK = 0.2  # seconds between looks at the run's state


class ProbeRun:
    """Runs one prober mode against ``kafka_config`` and ``redis_url``; ``run()`` returns the summary.

    ``stop`` ends the run early (for example on SIGTERM); ``progress`` receives counters about
    every ``_TICK`` seconds.
    """

    def __init__(self, kafka_config: Mapping[str, Any], redis_url: str, options: ProbeOptions, *,
                 progress: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.options = options
        self.stop = threading.Event()
        self._kafka = dict(kafka_config)
        self._redis_url = redis_url
        self._progress = progress
        self._lock = threading.Lock()
        self._verifier: Verifier | None = None
        self._log: EventLog | None = None
        self._publisher: ProbePublisher | None = None
        self._consumer: ProbeConsumer | None = None
        self._reader: EventFolderReader | None = None
        self._expected_fed = False
        self._publish_error: Exception | None = None
        self._interrupted = False

    def _feed(self, event: Event) -> None:
        if self._log is not None:
            self._log(event)
        if self._verifier is not None:
            with self._lock:
                self._verifier.feed(event)

    def run(self) -> dict[str, Any]:
        """Run to the end (plan published and everything settled, idle, duration, or ``stop``).

        Raises:
            SubscriptionNotFoundError: consume or check mode without a topic to create it from.
            OrderingLayerError: a topic or subscription cannot be made or used, or publishing failed
                other than by a failed publish of a key (which is retried).
        """
        opts = self.options
        started = time.monotonic()
        admin = Admin(self._kafka, redis_url=self._redis_url or None)
        settings = self._prepare(admin)
        if opts.mode in ("full", "check"):
            attempts = settings.dead_letter_policy.max_delivery_attempts \
                if settings and settings.dead_letter_policy else None
            self._verifier = Verifier(max_delivery_attempts=attempts, max_examples=opts.max_examples)
            for run, keys in (opts.expect or {}).items():
                for key, count in keys.items():
                    self._feed(Expectation(time.time(), run, key, count))
            self._expected_fed = bool(opts.expect)
        if opts.events_dir is not None and opts.mode in ("full", "consume", "check") and opts.from_events is None:
            self._log = EventLog(opts.events_dir / f"{opts.subscriber_id}.jsonl")
        publishing = self._start_publisher() if opts.mode in ("full", "publish") else None
        if opts.from_events is not None:
            self._reader = EventFolderReader(opts.from_events, lag=opts.lag)
        elif opts.mode != "publish":
            assert settings is not None
            self._consumer = ProbeConsumer(
                self._kafka, self._redis_url, opts.subscription_name, settings.topic, front_end=opts.front_end,
                handler=opts.handler, sink=self._feed, subscriber_id=opts.subscriber_id, workers=opts.workers,
                batch_size=opts.batch_size, flow_control=FlowControl(max_messages=opts.max_outstanding))
            self._consumer.start()
        try:
            self._wait(started, publishing)
        finally:
            self._interrupted = self.stop.is_set()
            self._teardown(publishing)
        if self._publish_error is not None:
            raise self._publish_error
        return self._summary(started)

    def _prepare(self, admin: Admin) -> SubscriptionSettings | None:
        """Create the topic and subscription when missing; return the subscription's settings."""
        opts = self.options
        if opts.mode in ("full", "publish"):
            admin.create_topic(opts.topic_name, partitions=opts.partitions, exist_ok=True)
        if opts.mode == "publish" or (opts.from_events is not None and not self._redis_url):
            return None
        try:
            return admin.store.settings(opts.subscription_name)
        except SubscriptionNotFoundError:
            if opts.from_events is not None:
                return None
            if opts.mode != "full" and opts.publish.topic is None:
                raise
        plan = opts.subscription_plan
        return admin.create_subscription(
            opts.subscription_name, topic=opts.topic_name, enable_message_ordering=True,
            ack_deadline=plan.ack_deadline, retry_policy=RetryPolicy(plan.minimum_backoff, plan.maximum_backoff),
            dead_letter_policy=DeadLetterPolicy(plan.dead_letter_topic, plan.max_delivery_attempts)
            if plan.dead_letter_topic else None)

    def _start_publisher(self) -> threading.Thread:
        opts = self.options
        producer = OrderedProducer(self._kafka)
        self._publisher = ProbePublisher(producer, opts.publish, self.stop)

        def publish() -> None:
            try:
                assert self._publisher is not None
                self._publisher.run()
            except Exception as exc:  # noqa: BLE001 - handed to run(), which raises it
                self._publish_error = exc
            finally:
                producer.close(30)

        thread = threading.Thread(target=publish, name="prober-publish", daemon=True)
        thread.start()
        return thread

    def _wait(self, started: float, publishing: threading.Thread | None) -> None:
        idle_from = started
        while not self.stop.wait(_TICK):
            if self._publish_error is not None:
                return
            if self._reader is not None:
                for event in self._reader.poll():
                    self._feed(event)
            if publishing is not None and not publishing.is_alive() and not self._expected_fed:
                self._feed_expectations()
                idle_from = time.monotonic()
            if self._progress is not None:
                self._progress(self.counters())
            if self._finished(started, idle_from, publishing):
                return

    def _finished(self, started: float, idle_from: float, publishing: threading.Thread | None) -> bool:
        """Publishing done and: everything expected settled, or idle, or (consume, check) the duration over."""
        opts = self.options
        if publishing is not None and publishing.is_alive():
            return False
        if opts.mode == "publish":
            return True
        now = time.monotonic()
        if opts.mode != "full" and opts.publish.duration and now - started >= opts.publish.duration:
            return True
        if self._verifier is not None:
            with self._lock:
                if self._verifier.expected_total() and self._verifier.complete():
                    return True
        last = self._reader.last_read if self._reader is not None else \
            self._consumer.last_delivery if self._consumer is not None else started
        if opts.idle_timeout and now - max(last, idle_from) >= opts.idle_timeout:
            _LOGGER.info("nothing new for %.0f s: ending the run", opts.idle_timeout)
            return True
        return False

    def _feed_expectations(self) -> None:
        assert self._publisher is not None
        self._expected_fed = True
        if self._verifier is None and self.options.events_dir is None:
            return
        run = self.options.run_id
        expectations = [Expectation(time.time(), run, key, count)
                        for key, count in self._publisher.expectations().items()]
        if self._verifier is not None:
            for event in expectations:
                self._feed(event)
        else:
            assert self.options.events_dir is not None
            log = EventLog(self.options.events_dir / f"publisher-{run}.jsonl")
            for event in expectations:
                log(event)
            log.close()

    def _teardown(self, publishing: threading.Thread | None) -> None:
        self.stop.set()
        if publishing is not None:
            publishing.join()
            if not self._expected_fed:
                self._feed_expectations()
        if self._consumer is not None:
            self._consumer.stop()
        if self._reader is not None:
            for event in self._reader.drain():
                self._feed(event)
            self._reader.close()
        if self._log is not None:
            self._log.close()

    def counters(self) -> dict[str, Any]:
        """Progress counters: published, deliveries, acked_messages, backlog, redeliveries, violations."""
        published = self._publisher.published if self._publisher is not None else 0
        out: dict[str, Any] = {"published": published,
                               "deliveries": self._consumer.deliveries if self._consumer is not None else 0}
        if self._verifier is not None:
            with self._lock:
                counts = self._verifier.counts
                out.update(deliveries=counts["deliveries"], acked_messages=counts["acked_messages"],
                           redeliveries=counts["redeliveries"], violations=self._verifier.violation_count())
                expected = self._verifier.expected_total() or published
                out["backlog"] = max(0, expected - counts["acked_messages"])
        return out

    def _summary(self, started: float) -> dict[str, Any]:
        opts = self.options
        summary: dict[str, Any] = {
            "mode": opts.mode, "run_id": opts.run_id, "topic": opts.topic_name,
            "subscription": None if opts.mode == "publish" else opts.subscription_name,
            "wall_seconds": round(time.monotonic() - started, 3),
            "interrupted": self._interrupted,  # stopped from outside: unconsumed messages count as lost
            "options": _options_json(opts)}
        if self._publisher is not None:
            publisher = self._publisher
            seconds = max(1e-9, publisher.finished - publisher.started)
            summary["publish"] = {"published": publisher.published, "failures": publisher.failures,
                                  "poison_published": publisher.poison_published,
                                  "seconds": round(seconds, 3), "rate_per_s": round(publisher.published / seconds, 1)}
            if opts.mode == "publish":
                summary["expected"] = {opts.run_id: publisher.expectations()}
        if self._consumer is not None:
            summary["consume"] = {"front_end": opts.front_end, "subscriber": opts.subscriber_id,
                                  "deliveries": self._consumer.deliveries}
        if self._reader is not None:
            summary["events"] = {"folder": str(opts.from_events), "late": self._reader.late,
                                 "malformed": self._reader.malformed}
        if self._verifier is not None:
            with self._lock:
                summary["verdict"] = self._verifier.finish()
            summary["ok"] = summary["verdict"]["ok"]
        else:
            planned = opts.publish.messages if opts.mode == "publish" and opts.publish.messages else None
            summary["ok"] = planned is None or sum(self._publisher.expectations().values()) == planned \
                if self._publisher is not None else True
        return summary


def _options_json(opts: ProbeOptions) -> dict[str, Any]:
    raw = dataclasses.asdict(opts)
    raw.pop("expect", None)
    raw["handler"]["slow_keys"] = sorted(opts.handler.slow_keys)
    for name in ("events_dir", "from_events"):
        raw[name] = str(raw[name]) if raw[name] is not None else None
    return raw
