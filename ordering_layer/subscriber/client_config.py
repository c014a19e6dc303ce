"""The subscriber's Kafka settings as other clients of it take them, the credential check, and the
layer's Redis URL.

The subscriber's settings feed a consumer, but also the dead-letter producer and the credential
probe, which take no consumer-only keys (librdkafka warns on each one it is given).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ordering_layer.auth import verify_kafka
from ordering_layer.errors import ConfigError
from ordering_layer.scheduler.settings import REDIS_URL_ENV, redis_url_or_env

CONSUMER_ONLY = ("group.", "session.", "heartbeat.", "max.poll", "auto.", "enable.auto",
                 "partition.assignment", "isolation", "on_commit")


def without_consumer_keys(kafka_config: Mapping[str, Any]) -> dict[str, Any]:
    """``kafka_config`` without the keys only a consumer takes."""
    return {k: v for k, v in kafka_config.items() if not k.startswith(CONSUMER_ONLY)}


def verify_credentials(kafka_config: Mapping[str, Any]) -> None:
    """Fail fast when the brokers refuse the SASL login or the TLS handshake (see ``verify_kafka``).

    Raises:
        AuthenticationError: ``server="kafka"``: a broker refused the login or the handshake.
        ConfigError: confluent-kafka refused the config itself.
    """
    verify_kafka(without_consumer_keys(kafka_config))


def redis_url_from(redis_url: str | None) -> str:
    """``redis_url`` or ``$ORDERING_LAYER_REDIS_URL``; ConfigError when neither is set."""
    url = redis_url_or_env(redis_url)
    if url is None:
        raise ConfigError(f"the layer's Redis is needed: pass redis_url= or set ${REDIS_URL_ENV}")
    return url
