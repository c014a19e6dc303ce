"""Kafka client settings read as librdkafka reads them, and cut down for the layer's own clients.

A drop-in wrapper takes the settings a program wrote for confluent-kafka (DRP-1, DRP-2), so the
layer reads them with librdkafka's rules before it acts on any of them:

- the nested ``default.topic.config`` dict of older programs holds topic-level settings
  (``auto.offset.reset``, ``acks``, ...) that librdkafka applies like top-level ones;
- ``auto.offset.reset`` has aliases: ``smallest``/``earliest``/``beginning`` and
  ``largest``/``latest``/``end``;
- booleans and numbers may be strings (``"false"``, ``"6000"``).

The layer's own Kafka clients (dead-letter producer, compacted topics, admin, the credential probe,
the scheduler's producer) get only ``connection_settings``: where the brokers are and how to log in.
The program's callbacks (``stats_cb``, ``error_cb``, ``on_commit``, ...) and its consumer or producer
tuning stay with the client the program asked for, and librdkafka has nothing to warn about.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from ordering_layer.errors import ConfigError

TOPIC_CONFIG = "default.topic.config"

_TRUE = ("true", "t", "1")
_FALSE = ("false", "f", "0")
_EARLIEST = ("smallest", "earliest", "beginning")
_LATEST = ("largest", "latest", "end")

# What every Kafka client needs to reach and log in to the brokers, by exact name or prefix.
_CONNECTION_NAMES = frozenset({
    "bootstrap.servers", "metadata.broker.list", "client.id", "client.rack", "client.dns.lookup",
    "security.protocol", "enable.ssl.certificate.verification", "enable.sasl.oauthbearer.unsecure.jwt",
    "oauth_cb", "connections.max.idle.ms", "broker.version.fallback", "plugin.library.paths",
    "debug", "log_level", "logger",
})
_CONNECTION_PREFIXES = ("ssl.", "ssl_", "sasl.", "socket.", "broker.address.", "reconnect.backoff.",
                        "retry.backoff.", "api.version.", "https.", "log.")


def read_kafka_config(config: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None = None,
                      ) -> dict[str, Any]:
    """A program's confluent-kafka settings as one flat dict (``overrides`` win over ``config``).

    The settings of ``default.topic.config`` join the top level. A setting given both there and
    at the top level with different values is refused: librdkafka's answer would depend on the
    order in which it applies the two.

    Raises:
        ConfigError: ``default.topic.config`` is not a dict, or contradicts a top-level setting
            (``setting`` names it).
    """
    conf = {**(config or {}), **(overrides or {})}
    nested = conf.pop(TOPIC_CONFIG, None)
    if nested is None:
        return conf
    if not isinstance(nested, Mapping):
        raise ConfigError(f"{TOPIC_CONFIG} must be a dict of topic settings, got {type(nested).__name__}",
                          setting=TOPIC_CONFIG)
    for name, value in nested.items():
        if name in conf and str(conf[name]).lower() != str(value).lower():
            raise ConfigError(f"{name!r} is set to {conf[name]!r} and, in {TOPIC_CONFIG}, to {value!r}",
                              setting=name)
        conf.setdefault(name, value)
    return conf


def flag(config: Mapping[str, Any], name: str, default: bool) -> bool:
    """The boolean setting ``name`` as librdkafka reads it (``True``, ``"true"``, ``"t"``, ``"1"``, ...).

    Raises:
        ConfigError: the value is not a boolean (``setting`` names it).
    """
    value = config.get(name, default)
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{name!r} expects true or false, got {value!r}", setting=name)


def integer(config: Mapping[str, Any], name: str, default: int) -> int:
    """The integer setting ``name``, given as a number or a string of digits.

    Raises:
        ConfigError: the value is not an integer (``setting`` names it).
    """
    value = config.get(name, default)
    if isinstance(value, bool):
        raise ConfigError(f"{name!r} expects an integer, got {value!r}", setting=name)
    try:
        return int(str(value).strip())
    except ValueError:
        raise ConfigError(f"{name!r} expects an integer, got {value!r}", setting=name) from None


def offset_reset(config: Mapping[str, Any], default: str = "latest") -> Literal["earliest", "latest"]:
    """``auto.offset.reset`` with librdkafka's aliases folded: ``earliest`` or ``latest``.

    Raises:
        ConfigError: ``error`` (a subscription always has a start position, GRP-1) or an unknown
            value; ``setting`` names it.
    """
    value = str(config.get("auto.offset.reset", default)).strip().lower()
    if value in _EARLIEST:
        return "earliest"
    if value in _LATEST:
        return "latest"
    if value == "error":
        raise ConfigError("auto.offset.reset=error cannot be honoured: a subscription always starts at a "
                          "position (earliest or latest)", setting="auto.offset.reset")
    raise ConfigError(f"auto.offset.reset expects smallest, earliest, beginning, largest, latest or end, got "
                      f"{config.get('auto.offset.reset')!r}", setting="auto.offset.reset")


# Consumer settings of which the layer honours only some values: the values, and why no other.
CONSUMER_HONOURS: dict[str, tuple[tuple[str, ...], str]] = {
    "enable.partition.eof": (_FALSE, "the layer delivers messages, not partition ends"),
    "partition.assignment.strategy": (("cooperative-sticky",), "ownership moves key by key only with "
                                                               "incremental (cooperative) rebalancing"),
    "group.protocol": (("classic",), "the subscriber runs the classic group protocol"),
}


def refuse_unhonoured(config: Mapping[str, Any], honours: Mapping[str, tuple[tuple[str, ...], str]],
                      client: str) -> None:
    """Refuse a setting of ``honours`` whose value ``client`` cannot honour.

    Raises:
        ConfigError: ``setting`` names it.
    """
    for name, (values, reason) in honours.items():
        if name in config and str(config[name]).strip().lower() not in values:
            raise ConfigError(f"{name}={config[name]!r} cannot be honoured by {client}: {reason}", setting=name)


def is_connection_setting(name: str) -> bool:
    """Whether every Kafka client takes ``name``: broker addresses, TLS, SASL, sockets, logging."""
    return name in _CONNECTION_NAMES or name.startswith(_CONNECTION_PREFIXES)


def connection_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """What one of the layer's own Kafka clients takes from a program's settings: how to reach and
    log in to the brokers, and nothing of the program's consumer or producer (``config`` flattened
    by ``read_kafka_config`` first)."""
    return {name: value for name, value in read_kafka_config(config).items() if is_connection_setting(name)}
