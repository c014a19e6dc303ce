"""Typed settings of scheduled-message activation (PUB-5)."""

from __future__ import annotations

import dataclasses
import os

from ordering_layer.config import DEFAULT_SCHEDULE_TOPIC
from ordering_layer.errors import ConfigError

__all__ = ["DEFAULT_SCHEDULE_TOPIC", "REDIS_URL_ENV", "SchedulerSettings", "redis_url_or_env"]

REDIS_URL_ENV = "ORDERING_LAYER_REDIS_URL"


def redis_url_or_env(redis_url: str | None) -> str | None:
    """``redis_url``, else ``$ORDERING_LAYER_REDIS_URL``, else None."""
    return redis_url or os.environ.get(REDIS_URL_ENV) or None


@dataclasses.dataclass(frozen=True)
class SchedulerSettings:
    """Where scheduled messages are kept and how schedulers activate them.

    Attributes:
        schedule_topic: the compacted Kafka topic of the layer's schedule records (created on
            first use); its name also names the Redis index, so schedulers of one topic share work.
        lease: seconds a scheduler holds the due messages it claimed; a crashed scheduler's claims
            are activated by another one after this.
        batch: most due messages claimed in one step.
        poll_interval: seconds between looks at the time index when nothing is due sooner.
        done_retention: seconds the terminal state (activated, cancelled) of a schedule id is kept,
            so that ``cancel_scheduled`` can tell "already enqueued" apart from "unknown".
    """

    schedule_topic: str = DEFAULT_SCHEDULE_TOPIC
    lease: float = 10.0
    batch: int = 1000
    poll_interval: float = 0.1
    done_retention: float = 7 * 24 * 3600.0

    def __post_init__(self) -> None:
        if not self.schedule_topic:
            raise ConfigError("schedule_topic must be a topic name")
        if self.lease <= 0 or self.poll_interval <= 0 or self.done_retention <= 0:
            raise ConfigError(f"lease, poll_interval and done_retention must be > 0, got {self}")
        if self.batch <= 0:
            raise ConfigError(f"batch must be > 0, got {self.batch}")
