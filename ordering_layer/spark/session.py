"""A SparkSession wired for Spark's Kafka source (INFRA.md, Spark).

The Kafka source is not inside pyspark: its jars are fetched with Maven (``ordering_layer.stack.jars``)
and passed with ``spark.jars``, never with ``spark.jars.packages`` (Ivy may not reach a registry).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from importlib import resources
from urllib.parse import urlsplit

from pyspark.sql import SparkSession

from ordering_layer.stack.jars import spark_kafka_jars

_LOGGER = logging.getLogger(__name__)

DEFAULT_SETTINGS: Mapping[str, str] = {
    "spark.driver.memory": "1g",
    "spark.sql.shuffle.partitions": "4",
    "spark.default.parallelism": "2",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.session.timeZone": "UTC",
    # Spark's default is 10,000 rows per Arrow batch; smaller batches keep the Python workers small.
    "spark.sql.execution.arrow.maxRecordsPerBatch": "5000",
    "spark.sql.streaming.forceDeleteTempCheckpointLocation": "true",
}


def _log_settings() -> dict[str, str]:
    """Spark's log at WARN from the first line: ``log4j2.properties`` shipped with this package
    (``setLogLevel`` comes only after the JVM has printed its start-up notices)."""
    config = resources.files("ordering_layer.spark") / "log4j2.properties"
    return {"spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile={config}"}


def _on_loopback(master: str) -> bool:
    """True for a local master, or a cluster master on this machine's loopback address."""
    return master.startswith("local") or urlsplit(master).hostname in ("127.0.0.1", "localhost")


def local_session(app_name: str = "ordering-layer", *, master: str = "local[2]",
                  settings: Mapping[str, str] | None = None) -> SparkSession:
    """A SparkSession whose driver runs here, with Spark's Kafka source on its class path.

    The master is local by default, or a cluster's (``spark://host:7077``: the Kafka source jars
    go to its executors through ``spark.jars``). Python workers run the interpreter that calls
    this (``PYSPARK_PYTHON`` is set to it unless it is set already), so they find
    ``ordering_layer``, pandas and pyarrow; a cluster's machines need that interpreter at the same
    path. Memory is small (driver 1g) and shuffles use few partitions; the driver logs warnings
    and errors only. ``settings`` override any Spark setting. With a local master, or one on
    127.0.0.1, the driver binds to 127.0.0.1 (``SPARK_LOCAL_IP`` unless set). If a session is
    active already, Spark returns it and settings that need a new JVM are ignored.

    Raises:
        StackError: the Kafka source jars cannot be fetched (Maven missing or failing).
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if _on_loopback(master):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    jars = ",".join(str(path) for path in spark_kafka_jars())
    builder = SparkSession.builder.master(master).appName(app_name).config("spark.jars", jars)
    for key, value in {**DEFAULT_SETTINGS, **_log_settings(), **(settings or {})}.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("WARN")
    _LOGGER.info("Spark %s session %r on %s", session.version, app_name, master)
    return session
