"""Fetch pinned Maven Central artifacts (the Kafka broker, Spark's Kafka source) into a cache.

The versions are pinned in the ``poms/*.xml`` files shipped with this package; Maven resolves the
transitive runtime dependencies and copies them into ``<cache>/jars/<name>-<version>``. A marker
file records a complete fetch, so an interrupted download is fetched again.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from importlib import resources
from pathlib import Path

from ordering_layer.errors import StackError

_LOGGER = logging.getLogger(__name__)

_COMPLETE = ".complete"


def cache_dir() -> Path:
    """The folder for jars and stack state: ``$ORDERING_LAYER_CACHE`` or ``~/.cache/ordering-layer``."""
    configured = os.environ.get("ORDERING_LAYER_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "ordering-layer"


def _pom(name: str) -> Path:
    return Path(str(resources.files("ordering_layer.stack") / "poms" / f"{name}.xml"))


def pinned_version(name: str, prop: str) -> str:
    """The version pinned as ``<prop>`` in the shipped ``poms/<name>.xml``."""
    match = re.search(rf"<{re.escape(prop)}>([^<]+)</{re.escape(prop)}>", _pom(name).read_text())
    if match is None:
        raise StackError(f"{_pom(name)} pins no <{prop}>")
    return match.group(1)


def kafka_version() -> str:
    """The pinned Apache Kafka broker version."""
    return pinned_version("kafka", "kafka.version")


def spark_version() -> str:
    """The pinned Spark version of the Kafka source jars (matches the pinned pyspark)."""
    return pinned_version("spark-kafka", "spark.version")


def fetch(name: str, version: str) -> Path:
    """Copy the runtime dependencies of ``poms/<name>.xml`` into the cache; return the folder.

    Raises:
        StackError: Maven is missing or the fetch failed (the message names the fix).
    """
    target = cache_dir() / "jars" / f"{name}-{version}"
    if (target / _COMPLETE).exists():
        return target
    mvn = shutil.which("mvn")
    if mvn is None:
        raise StackError("Maven ('mvn') is needed to fetch the jars: apt-get install -y maven")
    if target.exists():
        shutil.rmtree(target)
    _LOGGER.info("fetching %s %s jars into %s", name, version, target)
    result = subprocess.run(
        [mvn, "-q", "-B", "-f", str(_pom(name)), "dependency:copy-dependencies",
         f"-DoutputDirectory={target}", "-DincludeScope=runtime"],
        capture_output=True, text=True, check=False,
    )
    if result.returncode != 0:
        raise StackError(f"fetching {name} jars failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    (target / _COMPLETE).touch()
    return target


def kafka_jars() -> Path:
    """The folder holding the Kafka broker's jars, fetched on first use."""
    return fetch("kafka", kafka_version())


def kafka_tools_jars() -> Path:
    """The folder holding Kafka's command-line tools (ConsoleProducer, ...), fetched on first use;
    they run with the broker's jars on the class path too."""
    return fetch("kafka-tools", pinned_version("kafka-tools", "kafka.version"))


def spark_kafka_jars() -> list[Path]:
    """The jars of Spark's Kafka source (``spark.jars``), fetched on first use."""
    return sorted(fetch("spark-kafka", spark_version()).glob("*.jar"))

