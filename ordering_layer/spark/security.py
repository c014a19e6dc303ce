"""The layer's Kafka client settings (confluent-kafka's names) as options of Spark's Kafka source.

Spark's Kafka source runs the Java client, which takes other names for the same settings: the SASL
login is one JAAS line (``sasl.jaas.config``) holding the user and password, and the CA certificate
is a trust store (``ssl.truststore.type=PEM``, supported by the Java client since Kafka 2.7). The
options built here hold the password: they go straight to the source (``set_source_options``) and
are never logged, and no error raised here quotes a setting's value.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, TypeVar

from pyspark.sql import DataFrameReader
from pyspark.sql.streaming.readwriter import DataStreamReader

from ordering_layer.errors import ConfigError

_Reader = TypeVar("_Reader", DataFrameReader, DataStreamReader)
# py4j logs every command it sends to the JVM at DEBUG, the values of string arguments included.
_PY4J_LOGGERS = ("py4j.clientserver", "py4j.java_gateway")

_LOGIN_MODULES = {"SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
                  "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
                  "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule"}
# Settings of a secured config that have no translation here; the Java client's own can be passed
# as ``kafka.*`` source options instead.
_UNTRANSLATED = ("ssl.certificate.location", "ssl.key.location", "ssl.keystore.location", "sasl.oauthbearer.",
                 "sasl.kerberos.")


def _jaas_quoted(value: str) -> str:
    """``value`` as a double-quoted JAAS option value (the Java client's parser undoes the escapes)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def kafka_source_options(kafka_config: Mapping[str, Any]) -> dict[str, str]:
    """The ``kafka.*`` options of Spark's Kafka source that secure it as ``kafka_config`` does.

    Translated: ``security.protocol``; ``sasl.mechanism`` (or ``sasl.mechanisms``) SCRAM-SHA-256,
    SCRAM-SHA-512 or PLAIN with ``sasl.username`` and ``sasl.password`` (into ``kafka.sasl.jaas.config``);
    ``ssl.ca.location`` (a PEM file, into a PEM trust store); ``ssl.endpoint.identification.algorithm``.
    A plaintext config gives no option. The result holds the password: do not log it.

    Raises:
        ConfigError: a SASL mechanism or a client-certificate setting that is not translated, or a
            SASL login without user or password (the message names settings, never their values).
    """
    protocol = str(kafka_config.get("security.protocol") or "PLAINTEXT").upper()
    options: dict[str, str] = {}
    if protocol == "PLAINTEXT":
        return options
    untranslated = sorted(key for key in kafka_config if key.startswith(_UNTRANSLATED))
    if untranslated:
        raise ConfigError(f"Kafka settings {', '.join(untranslated)} are not translated for Spark's Kafka "
                          "source: pass the Java client's kafka.ssl.* or kafka.sasl.* options instead")
    options["kafka.security.protocol"] = protocol
    if protocol.startswith("SASL_"):
        mechanism = str(kafka_config.get("sasl.mechanism") or kafka_config.get("sasl.mechanisms") or "GSSAPI").upper()
        module = _LOGIN_MODULES.get(mechanism)
        if module is None:
            raise ConfigError(f"SASL mechanism {mechanism} is not translated for Spark's Kafka source "
                              f"(translated: {', '.join(_LOGIN_MODULES)}); pass kafka.sasl.jaas.config instead")
        user, password = kafka_config.get("sasl.username"), kafka_config.get("sasl.password")
        if not user or not password:
            raise ConfigError(f"SASL {mechanism} needs sasl.username and sasl.password")
        options["kafka.sasl.mechanism"] = mechanism
        options["kafka.sasl.jaas.config"] = (f"{module} required username={_jaas_quoted(str(user))} "
                                             f"password={_jaas_quoted(str(password))};")
    if protocol.endswith("SSL"):
        ca = kafka_config.get("ssl.ca.location")
        if ca:
            options["kafka.ssl.truststore.type"] = "PEM"
            options["kafka.ssl.truststore.location"] = str(ca)
        identification = kafka_config.get("ssl.endpoint.identification.algorithm")
        if identification is not None:
            options["kafka.ssl.endpoint.identification.algorithm"] = \
                "" if str(identification).lower() == "none" else str(identification)
    return options


def set_source_options(reader: _Reader, options: Mapping[str, str]) -> _Reader:
    """``reader.options(**options)`` without py4j logging the values (they may hold a password).

    py4j's command loggers are held at INFO or above while the options cross to the JVM; after
    that only object references cross, never the values.
    """
    loggers = [logging.getLogger(name) for name in _PY4J_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(logger.getEffectiveLevel(), logging.INFO))
    try:
        return reader.options(**options)
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
