"""Scheduled messages activated through an ``OrderedProducer`` (PUB-5).

The scheduler publishes through the producer it is given (``scheduler.scheduler``). Here it gets
one: ``Scheduler`` (the public class) and ``join_activation`` (what ``Subscriber`` and
``OrderedConsumer`` call) make an ``OrderedProducer`` of the scheduler's own on its first
activation, closed when it stops. ``OrderedProducer`` takes part with itself as the producer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ordering_layer.publisher.producer import OrderedProducer
from ordering_layer.scheduler import participant, scheduler
from ordering_layer.scheduler.book import ScheduleBook
from ordering_layer.scheduler.participant import Activation
from ordering_layer.scheduler.settings import SchedulerSettings

__all__ = ["Scheduler", "join_activation", "own_producer"]


def own_producer(connection: Mapping[str, Any]) -> OrderedProducer:
    """A scheduler's own producer, which does not take part in activation itself."""
    return OrderedProducer(connection, settings={"scheduler": False})


class Scheduler(scheduler.Scheduler):
    """Activates due scheduled messages on a named daemon thread until ``stop``.

    Args:
        kafka_config: confluent-kafka settings (``bootstrap.servers`` at least).
        redis_url: the Redis holding the time index.
        producer: the ``OrderedProducer`` to publish through; without one the scheduler makes its
            own on the first activation and closes it at ``stop``.
        settings: ``SchedulerSettings`` or a mapping of its fields.
        book: a ``ScheduleBook`` to share (e.g. the producer's own); made from the above otherwise.
        name: the thread's name.

    Raises:
        ConfigError: an unknown or invalid setting.
    """

    def __init__(self, kafka_config: Mapping[str, Any], redis_url: str, *,
                 producer: OrderedProducer | None = None,
                 settings: SchedulerSettings | Mapping[str, Any] | None = None,
                 book: ScheduleBook | None = None, name: str = "ordering-layer-scheduler") -> None:
        super().__init__(kafka_config, redis_url, producer=producer, make_producer=own_producer,
                         settings=settings, book=book, name=name)


def join_activation(kafka_config: Mapping[str, Any], redis_url: str | None = None, *,
                    enabled: bool = True, settings: SchedulerSettings | None = None) -> Activation:
    """``participant.join_activation`` with a producer of the scheduler's own: start activating due
    scheduled messages from this client when a Redis URL is known (``redis_url``, default
    ``$ORDERING_LAYER_REDIS_URL``) and ``enabled`` (``$ORDERING_LAYER_SCHEDULER=0`` switches it off);
    ``settings``: the schedule topic and leases.

    Returns:
        An object whose ``close()`` stops taking part (a no-op when it did not).
    """
    return participant.join_activation(kafka_config, redis_url, enabled=enabled, make_producer=own_producer,
                                      settings=settings)
