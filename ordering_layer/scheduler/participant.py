"""Taking part in activation from any running client of the layer (PUB-5).

Service Bus needs no extra process for scheduled messages, so every running ``OrderedProducer``,
``Subscriber`` and ``OrderedConsumer`` activates due messages by default. ``join_activation`` is
the one call a front end makes: it starts a ``Scheduler`` when a Redis URL is known and taking
part is not switched off, and returns something to ``close()`` in any case. ``OrderedProducer``
passes itself as the producer; the subscriber's front ends call it through
``publisher.activation``, which makes them a producer of their own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, Protocol

from ordering_layer.scheduler.book import ScheduleBook
from ordering_layer.scheduler.scheduler import MakePublisher, Publisher, Scheduler
from ordering_layer.scheduler.settings import SchedulerSettings, redis_url_or_env

_LOGGER = logging.getLogger(__name__)

SWITCH_ENV = "ORDERING_LAYER_SCHEDULER"  # "0", "false" or "off": no client takes part by default


class Activation(Protocol):
    """What ``join_activation`` returns: close it with its owner."""

    def close(self) -> None:
        """Stop taking part in activation."""


class _NotTakingPart:
    def close(self) -> None:
        """Nothing to stop."""


class _TakingPart:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def close(self) -> None:
        """Stop the scheduler thread (and the producer it made)."""
        self.scheduler.stop()


def switched_on(enabled: bool = True) -> bool:
    """``enabled``, unless ``$ORDERING_LAYER_SCHEDULER`` switches taking part off."""
    return enabled and os.environ.get(SWITCH_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def join_activation(kafka_config: Mapping[str, Any], redis_url: str | None = None, *, enabled: bool = True,
                    producer: Publisher | None = None, make_producer: MakePublisher | None = None,
                    book: ScheduleBook | None = None, settings: SchedulerSettings | None = None) -> Activation:
    """Start activating due scheduled messages from this client, if it can and may.

    Args:
        kafka_config: the client's confluent-kafka settings (consumer settings are dropped).
        redis_url: the layer's Redis (default ``$ORDERING_LAYER_REDIS_URL``); without one the
            client does not take part.
        enabled: False switches taking part off (as does ``$ORDERING_LAYER_SCHEDULER=0``).
        producer, make_producer: publish through this producer, or one ``make_producer`` makes on the
            first activation (``Scheduler``).
        book, settings: share the caller's ``ScheduleBook``; the schedule topic and leases.

    Returns:
        An object whose ``close()`` stops taking part (a no-op when it did not).
    """
    url = redis_url_or_env(redis_url)
    if not url or not switched_on(enabled):
        return _NotTakingPart()
    scheduler = Scheduler(kafka_config, url, producer=producer, make_producer=make_producer,
                          settings=settings or (book.settings if book else None), book=book)
    scheduler.start()
    return _TakingPart(scheduler)
