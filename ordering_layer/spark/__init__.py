"""Spark side of the layer: read topics with Spark's Kafka source and restore per-key order (SPK-1..SPK-3).

Needs the ``spark`` extra (pyspark, pandas, pyarrow) and Spark's Kafka source jars, which
``local_session`` fetches with Maven and passes with ``spark.jars``.
"""

from ordering_layer.spark.demo import demo_step
from ordering_layer.spark.export import ExportSummary, export_ordered
from ordering_layer.spark.reader import read_ordered, read_ordered_stream
from ordering_layer.spark.restore import restore_order, restore_order_stream
from ordering_layer.spark.session import local_session

__all__ = ["ExportSummary", "demo_step", "export_ordered", "local_session", "read_ordered", "read_ordered_stream",
           "restore_order", "restore_order_stream"]
