"""The layer's Kafka settings as Spark Kafka source options (issue 13), without servers."""

from __future__ import annotations

import pytest

pytest.importorskip("pyspark")

from ordering_layer.errors import ConfigError
from ordering_layer.spark.security import kafka_source_options

SECRET = 'pa"ss\\word-0123456789'
SECURED = {"bootstrap.servers": "b:9093", "security.protocol": "sasl_ssl", "sasl.mechanism": "SCRAM-SHA-512",
           "sasl.username": "ol-client", "sasl.password": SECRET, "ssl.ca.location": "/certs/ca.pem"}


def test_sasl_ssl_scram_becomes_a_jaas_line_and_a_pem_trust_store() -> None:
    """SCRAM over TLS: the JAAS line quotes the user and password (quotes and backslashes escaped), the CA
    becomes a PEM trust store."""
    assert kafka_source_options(SECURED) == {
        "kafka.security.protocol": "SASL_SSL", "kafka.sasl.mechanism": "SCRAM-SHA-512",
        "kafka.sasl.jaas.config": 'org.apache.kafka.common.security.scram.ScramLoginModule required '
                                  'username="ol-client" password="pa\\"ss\\\\word-0123456789";',
        "kafka.ssl.truststore.type": "PEM", "kafka.ssl.truststore.location": "/certs/ca.pem"}


def test_plaintext_gives_no_option_and_tls_alone_no_login() -> None:
    """A plaintext config adds nothing; SSL without SASL gives the trust store and no JAAS line."""
    assert kafka_source_options({"bootstrap.servers": "b:9092"}) == {}
    assert kafka_source_options({"security.protocol": "SSL", "ssl.ca.location": "/ca.pem",
                                 "ssl.endpoint.identification.algorithm": "none"}) == {
        "kafka.security.protocol": "SSL", "kafka.ssl.truststore.type": "PEM",
        "kafka.ssl.truststore.location": "/ca.pem", "kafka.ssl.endpoint.identification.algorithm": ""}


@pytest.mark.parametrize("changed", [{"sasl.mechanism": "OAUTHBEARER"}, {"ssl.key.location": "/key.pem"},
                                     {"sasl.username": ""}])
def test_untranslated_settings_are_refused_without_the_password(changed: dict[str, str]) -> None:
    """An untranslated mechanism, a client certificate or a missing user raise ConfigError; the
    message names settings and never holds the password."""
    with pytest.raises(ConfigError) as raised:
        kafka_source_options({**SECURED, **changed})
    assert SECRET not in str(raised.value) and "0123456789" not in repr(raised.value)
