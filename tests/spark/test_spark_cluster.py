"""Spark on a standalone cluster: the export job and an order-restoring program through
``spark-submit --master spark://...`` (SPK-1, SPK-2, SPK-3 on executors of their own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import pyarrow.parquet as pq
import pytest
from pyspark.sql import SparkSession

from ordering_layer import Admin
from ordering_layer.spark import export_ordered, read_ordered, restore_order
from ordering_layer.stack import Endpoints, LocalStack, SparkCluster, StackBackend
from ordering_layer.stack.jars import spark_kafka_jars
from ordering_layer.stack.processes import alive
from ordering_layer.stack.spark_cluster import read_master_state, spark_submit
from tests.spark.restore_program import as_json
from tests.spark.workload import Workload

pytestmark = [pytest.mark.spark, pytest.mark.integration]

JOB = Path(__file__).resolve().parents[2] / "spark" / "ordered_export.py"
PROGRAM = Path(__file__).resolve().with_name("restore_program.py")
SPLIT = b"plain-split"
SUBMIT_TIMEOUT = 300


class SparkMaster(NamedTuple):
    """The cluster the jobs are submitted to; ``ui`` is empty for one named by environment."""

    url: str
    ui: str


@pytest.fixture(scope="module")
def spark_master(stack: StackBackend | None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkMaster]:
    """A Spark master with one worker (1 core, 1g) for this module: the session stack's own
    (``start_spark``, stopped at the end), or a ``SparkCluster`` when the session's Kafka is not a
    local stack. ``ORDERING_LAYER_SPARK_MASTER`` names an existing one instead (its executors must
    share this machine's file system: the jobs write their output to the test's folder)."""
    named = os.environ.get("ORDERING_LAYER_SPARK_MASTER")
    if named:
        yield SparkMaster(named, "")
        return
    if isinstance(stack, LocalStack):
        url = stack.start_spark()
        spark = stack.status()["spark"]
        try:
            assert stack.endpoints().spark_master == url and spark["running"], spark
            assert f"export ORDERING_LAYER_SPARK_MASTER={url}" in stack.endpoints().env_lines()
            yield SparkMaster(url, spark["ui"])
        finally:
            stack.stop_spark()
        assert not alive(spark["master_pid"]) and not alive(spark["worker_pid"])
        assert "spark" not in stack.status() and not stack.endpoints().spark_master
        return
    cluster = SparkCluster(tmp_path_factory.mktemp("spark-cluster"))
    try:
        yield SparkMaster(cluster.up(), cluster.ui_url())
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def workload(kafka_config: dict[str, Any], admin: Admin) -> Iterator[Workload]:
    """12 layer keys over 3 partitions with raw copies, unordered messages, and a plain producer's
    records: a key in two partitions (order undefined) and a malformed ol- header."""
    topic = f"spark-cluster-{uuid.uuid4().hex[:8]}"
    admin.create_topic(topic, partitions=3)
    work = Workload(kafka_config, admin, topic, keys=12, partitions=3)
    try:
        work.publish_rounds(3)
        work.republish(every=2, partitioner="murmur2_random")
        work.produce_plain(b"plain", 2, partition=2)
        work.produce_plain(SPLIT, 1, partition=0)
        work.produce_plain(SPLIT, 1, partition=1, headers=[("ol-partition-count", b"0")], malformed=True)
        work.publish_rounds(2)
        work.publish_unordered(3)
    finally:
        work.close()
    assert work.undefined == {SPLIT}
    yield work


def submit(master: SparkMaster, program: Path, *args: str) -> str:
    """Run ``program`` with spark-submit on ``master`` (the Kafka source jars shipped with ``--jars``,
    this interpreter as the executors' Python, one executor of 1 core and 1g); return its output.
    The driver logs warnings only."""
    log4j = resources.files("ordering_layer.spark") / "log4j2.properties"
    command = [str(spark_submit()), "--master", master.url,
               "--jars", ",".join(str(path) for path in spark_kafka_jars()),
               "--driver-memory", "1g", "--executor-memory", "1g", "--total-executor-cores", "1",
               "--conf", "spark.sql.shuffle.partitions=4",
               "--conf", f"spark.driver.extraJavaOptions=-Dlog4j2.configurationFile={log4j}",
               str(program), *args]
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("PYSPARK_GATEWAY") and name != "SPARK_ENV_LOADED"}
    env["PYSPARK_PYTHON"] = sys.executable
    if urlsplit(master.url).hostname in ("127.0.0.1", "localhost"):
        env["SPARK_LOCAL_IP"] = "127.0.0.1"
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=SUBMIT_TIMEOUT, check=False)
    assert result.returncode == 0, f"{program.name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result.stdout


def finished_on_cluster(master: SparkMaster, name: str) -> None:
    """The master lists a finished application ``name`` that had executor cores (known when it has a UI)."""
    if not master.ui:
        return
    state = read_master_state(master.ui)
    apps = [app for app in state["completedapps"] if app["name"] == name]
    assert apps and all(app["state"] == "FINISHED" and app["cores"] >= 1 for app in apps), state["completedapps"]


def kafka_arguments(endpoints: Endpoints) -> list[str]:
    """``--bootstrap`` and, for a secured session, ``--kafka-config``."""
    config = ["--kafka-config", endpoints.kafka_config_file] if endpoints.kafka_config_file else []
    return ["--bootstrap", endpoints.bootstrap, *config]


def parquet_rows(folder: Path) -> list[dict[str, Any]]:
    """Every row of an export, in (key, key_sequence, message_id) order."""
    rows: list[dict[str, Any]] = pq.read_table(folder).to_pylist()
    return sorted(rows, key=lambda row: (row["key"] or b"", row["key_sequence"] or 0, row["message_id"]))


def test_export_job_on_the_cluster_writes_what_local_mode_writes(
        spark_master: SparkMaster, spark: SparkSession, workload: Workload, endpoints: Endpoints,
        kafka_config: dict[str, Any], tmp_path: Path) -> None:
    """SPK-2 on a cluster: ``spark/ordered_export.py`` submitted to the standalone master writes
    the same rows as the same export in local mode, each key's messages in one file, contiguous,
    in publish order without duplicates; the key of two partitions flagged."""
    start = time.perf_counter()
    out = tmp_path / "cluster-export"
    printed = submit(spark_master, JOB, "--topic", workload.topic, *kafka_arguments(endpoints),
                     "--out", str(out), "--files", "3")
    print(f"export through spark-submit: {time.perf_counter() - start:.1f} s")
    assert f"{workload.copies} duplicates dropped" in printed, printed
    assert "1 keys without a defined order" in printed and "1 records with malformed ol- headers" in printed, printed
    finished_on_cluster(spark_master, "ordered-export")

    local = tmp_path / "local-export"
    export_ordered(spark, workload.topic, kafka_config["bootstrap.servers"], str(local), files=3,
                   kafka_config=kafka_config)
    assert parquet_rows(out) == parquet_rows(local)

    per_key: dict[bytes, list[tuple[int, str]]] = defaultdict(list)
    for path in sorted(out.glob("part-*.parquet")):
        keys = [row["key"] for row in pq.read_table(path, columns=["key"]).to_pylist() if row["key"] is not None]
        runs = [key for i, key in enumerate(keys) if i == 0 or keys[i - 1] != key]
        assert len(runs) == len(set(runs)), f"a key's messages are split up in {path.name}"
    for row in parquet_rows(out):
        if row["key"] is not None:
            per_key[row["key"]].append((row["key_sequence"], row["message_id"]))
    assert set(per_key) == set(workload.truth)
    for key, rows in per_key.items():
        assert [sequence for sequence, _ in rows] == list(range(1, len(rows) + 1)), key
        if key != SPLIT:
            assert [message_id for _, message_id in rows] == workload.truth[key], key


def test_order_restoring_read_on_the_cluster(spark_master: SparkMaster, spark: SparkSession, workload: Workload,
                                             endpoints: Endpoints, kafka_config: dict[str, Any],
                                             tmp_path: Path) -> None:
    """SPK-2 / SPK-3 on a cluster: a program submitted to the standalone master reads the topic
    with ``read_ordered`` + ``restore_order`` and with the streaming pair; the batch rows equal
    local mode's, every key comes out in publish order numbered 1..n, and the stream emits each
    message once, each key's in that order across micro-batches."""
    start = time.perf_counter()
    out = tmp_path / "restored.json"
    submit(spark_master, PROGRAM, "--topic", workload.topic, *kafka_arguments(endpoints),
           "--checkpoint", str(tmp_path / "checkpoint"), "--out", str(out))
    print(f"order-restoring read through spark-submit: {time.perf_counter() - start:.1f} s")
    result = json.loads(out.read_text())
    assert result["master"] == spark_master.url
    finished_on_cluster(spark_master, "restore-order")

    local = restore_order(read_ordered(spark, workload.topic, kafka_config["bootstrap.servers"],
                                       kafka_config=kafka_config)).collect()

    def ordered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return sorted(rows, key=lambda row: (row["key"] or "", row["key_sequence"] or 0, row["message_id"]))

    assert ordered(result["batch"]) == ordered([as_json(row) for row in local])

    for form in ("batch", "stream"):
        rows = result[form]
        assert len({row["message_id"] for row in rows}) == len(rows), f"{form}: a message came out twice"
        per_key: dict[bytes, list[dict[str, Any]]] = defaultdict(list)
        for row in rows:
            if row["key"] is not None:
                per_key[bytes.fromhex(row["key"])].append(row)
        assert set(per_key) == set(workload.truth), form
        for key, key_rows in per_key.items():
            key_rows.sort(key=lambda row: row["key_sequence"])
            if form == "stream":  # a key's later messages come in the same micro-batch or a later one
                batch_ids = [row["batch_id"] for row in key_rows]
                assert batch_ids == sorted(batch_ids), key
            assert [row["key_sequence"] for row in key_rows] == list(range(1, len(key_rows) + 1)), (form, key)
            if key == SPLIT:  # flagged once its second partition is seen; the stream may emit it before
                assert key_rows[-1]["order_undefined"], form
                assert sorted(row["message_id"] for row in key_rows) == sorted(workload.truth[key]), form
                continue
            assert not any(row["order_undefined"] for row in key_rows), (form, key)
            assert [row["message_id"] for row in key_rows] == workload.truth[key], (form, key)
        unordered = sorted(row["message_id"] for row in rows if row["key"] is None)
        assert unordered == sorted(workload.unordered), form
    assert len({row["batch_id"] for row in result["stream"]}) > 1, "the stream ran in a single micro-batch"
