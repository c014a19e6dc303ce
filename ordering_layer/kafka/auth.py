"""Fail fast, and by name, when Kafka refuses our credentials or certificate.

librdkafka retries a refused SASL login or TLS handshake forever and reports it only to an error
callback, so a wrong password looks like a broker that does not answer. ``verify_kafka`` makes one
short-lived metadata request and turns those reports into ``AuthenticationError(server="kafka")``
(``state.client.verify_redis`` does the same for Redis). The message carries no secret.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from ordering_layer.errors import AuthenticationError, ConfigError
from ordering_layer.kafka_config import connection_settings

__all__ = ["verify_kafka"]

_LOGGER = logging.getLogger(__name__)

_REFUSED = {KafkaError._AUTHENTICATION: "refused the SASL credentials", KafkaError._SSL: "TLS handshake failed"}
_UNREACHABLE = {KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT, KafkaError._RESOLVE}
# Keys of the caller's config the probe leaves out: the callbacks it replaces with its own, and the
# producer's and consumer's Python-level callbacks, which an AdminClient refuses as unknown.
_PROBE_OWN = ("error_cb", "logger", "stats_cb", "throttle_cb", "oauth_cb", "on_delivery", "on_commit")


def verify_kafka(config: Mapping[str, Any], timeout: float = 10.0) -> None:
    """Check that the brokers of ``config`` accept its TLS and SASL settings (a plaintext config
    has neither: it returns at once).

    Returns once metadata arrives, or as soon as the brokers are plainly unreachable (a broker that
    is down is left to the caller's own calls and their retries), or after ``timeout`` seconds.

    Args:
        config: a confluent-kafka config (``bootstrap.servers``, ``security.protocol``, ``sasl.*``,
            ``ssl.*``, ...).
        timeout: seconds to wait for an answer.

    Raises:
        AuthenticationError: with ``server="kafka"``: a broker refused the login or the handshake.
        ConfigError: confluent-kafka refused the config itself.
    """
    if str(config.get("security.protocol", "plaintext")).lower() == "plaintext":
        # No credentials and no handshake to refuse: nothing to check, and no wait for a broker
        # that is down or drops packets (a plain confluent client does not wait at construction).
        return
    reports: list[KafkaError] = []
    probe_config = {key: value for key, value in connection_settings(config).items() if key not in _PROBE_OWN}
    probe_config.update(error_cb=reports.append, logger=logging.getLogger("ordering_layer.kafka.verify"))
    try:
        probe = AdminClient(probe_config)
    except KafkaException as exc:
        raise ConfigError(f"Kafka config refused: {exc.args[0]}") from None
    user = config.get("sasl.username")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            probe.list_topics(timeout=0.5)
            return
        except KafkaException:
            pass
        probe.poll(0)  # runs error_cb for what librdkafka reported meanwhile
        for report in reports:
            if report.code() in _REFUSED:
                who = f" (user {user!r})" if user and report.code() == KafkaError._AUTHENTICATION else ""
                raise AuthenticationError(f"Kafka {_REFUSED[report.code()]}{who}: {report.str()}", server="kafka")
        if any(report.code() in _UNREACHABLE for report in reports):
            _LOGGER.debug("Kafka brokers unreachable while verifying credentials: %s", reports[-1].str())
            return
