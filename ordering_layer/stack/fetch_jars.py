"""``python -m ordering_layer.stack.fetch_jars``: fetch every pinned jar set (``make jars``).

A module of its own, which the package never imports, so that ``-m`` runs it without runpy's
warning about a module already imported by its package.
"""

from __future__ import annotations

import logging

from ordering_layer.stack.jars import kafka_jars, kafka_tools_jars, kafka_version, spark_kafka_jars, spark_version


def main() -> None:
    """Fetch the Kafka broker's jars, Kafka's command-line tools and Spark's Kafka source jars into
    the cache; print where."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"kafka {kafka_version()}: {kafka_jars()}")
    print(f"kafka-tools {kafka_version()}: {kafka_tools_jars()}")
    print(f"spark-kafka {spark_version()}: {len(spark_kafka_jars())} jars")


if __name__ == "__main__":
    main()
