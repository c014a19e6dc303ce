"""Spark's Kafka source through the secured stack (issue 13): SASL_SSL with SCRAM-SHA-512 and the stack's
CA as a PEM trust store, built from the layer's Kafka config; the password is shown nowhere."""

from __future__ import annotations

import logging
import uuid
from collections import defaultdict
from typing import Any

import pytest
from py4j.protocol import Py4JJavaError  # type: ignore[import-untyped]
from pyspark.sql import SparkSession

from ordering_layer import Admin
from ordering_layer.spark import read_ordered
from ordering_layer.stack import LocalStack
from tests.integration.conftest import publish_keys

pytestmark = [pytest.mark.spark, pytest.mark.integration, pytest.mark.secure]


def test_read_ordered_through_sasl_ssl_never_shows_the_password(
        spark: SparkSession, ordering_layer_secure_stack: LocalStack, caplog: pytest.LogCaptureFixture,
        capfd: pytest.CaptureFixture[str]) -> None:
    """SPK-1 over SASL_SSL: ``read_ordered(..., kafka_config=...)`` reads every message of a topic of the
    secured stack, each key in order; with a wrong password the read fails. Neither password is in the
    captured logs and output, the query plan, the error, or a repr of the reader's options."""
    caplog.set_level(logging.DEBUG)
    secure = ordering_layer_secure_stack.endpoints()
    kafka: dict[str, Any] = secure.kafka_config()
    password, wrong = str(kafka["sasl.password"]), f"wrong-{uuid.uuid4().hex}"
    topic = f"spark-secure-{uuid.uuid4().hex[:8]}"
    Admin(kafka).create_topic(topic, partitions=2)
    publish_keys(kafka, topic, keys=3, per_key=4)

    frame = read_ordered(spark, topic, secure.bootstrap, kafka_config=kafka)
    by_key: dict[str, list[tuple[int, bytes]]] = defaultdict(list)
    for row in frame.select("ordering_key", "sequence_number", "data").collect():
        by_key[row.ordering_key].append((row.sequence_number, bytes(row.data)))
    assert {key: [data for _, data in sorted(rows)] for key, rows in by_key.items()} == \
        {f"key-{k}": [f"key-{k}:{n}".encode() for n in range(4)] for k in range(3)}
    frame.explain(extended=True)
    seen = [frame._jdf.queryExecution().toString(), repr(frame)]

    with pytest.raises(Py4JJavaError) as raised:
        read_ordered(spark, topic, secure.bootstrap, kafka_config={**kafka, "sasl.password": wrong}).count()
    seen += [str(raised.value), repr(raised.value)]
    assert "Authentication failed" in str(raised.value), str(raised.value)[:2000]

    captured = capfd.readouterr()
    text = "\n".join([caplog.text, captured.out, captured.err, *seen])
    for secret in (password, wrong):
        assert secret not in text
