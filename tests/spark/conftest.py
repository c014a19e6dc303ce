"""One local SparkSession (with Spark's Kafka source) for the whole test session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pandas")

from pyspark.sql import SparkSession

from ordering_layer.spark import local_session


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """A ``local[2]`` session, 1g driver, 4 shuffle partitions, Kafka source jars on its class path."""
    session = local_session("ordering-layer-tests")
    try:
        yield session
    finally:
        session.stop()
