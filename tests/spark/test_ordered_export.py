"""The ``spark/ordered_export.py`` job: SPK-1, SPK-2 end to end."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import uuid
from collections import defaultdict
from pathlib import Path
from types import ModuleType
from typing import Any

import pyarrow.parquet as pq
import pytest
from pyspark.sql import SparkSession

from ordering_layer import Admin
from tests.spark.workload import Workload

pytestmark = [pytest.mark.spark, pytest.mark.integration]

JOB = Path(__file__).resolve().parents[2] / "spark" / "ordered_export.py"


def test_job_help() -> None:
    """SPK-1: the export job documents itself with ``--help``."""
    result = subprocess.run([sys.executable, str(JOB), "--help"], capture_output=True, text=True, check=False,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--topic" in result.stdout and "--out" in result.stdout and "--bootstrap" in result.stdout


def _job() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ordered_export", JOB)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_job_exports_one_ordered_sequence_per_key(spark: SparkSession, kafka_config: dict[str, Any], admin: Admin,
                                                  tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """SPK-2 / PUB-7: the job (its ``main``, in the test's Spark session) writes Parquet in which each
    key's messages lie in one file, contiguous, in publish order without duplicates; a plain
    producer's records are exported too, a key of theirs in two partitions flagged, a malformed
    ol- header counted."""
    topic = f"spark-export-{uuid.uuid4().hex[:8]}"
    admin.create_topic(topic, partitions=3)
    work = Workload(kafka_config, admin, topic, keys=12, partitions=3)
    try:
        work.publish_rounds(3)
        work.republish(every=2, partitioner="murmur2_random")
        work.produce_plain(b"plain", 2, partition=2)
        work.produce_plain(b"split", 1, partition=0)
        work.produce_plain(b"split", 1, partition=1, headers=[("ol-partition-count", b"0")], malformed=True)
        work.publish_rounds(2)
        work.publish_unordered(3)
    finally:
        work.close()

    out = tmp_path / "export"
    assert _job().main(["--topic", topic, "--bootstrap", kafka_config["bootstrap.servers"], "--out", str(out),
                        "--files", "3"]) == 0
    printed = capsys.readouterr().out
    assert f"{work.copies} duplicates dropped" in printed, printed
    assert "1 keys without a defined order" in printed and "1 records with malformed ol- headers" in printed, printed
    assert spark.range(3).count() == 3  # the job left the session it did not start running

    files = sorted(out.glob("part-*.parquet"))
    file_of: dict[bytes, set[int]] = defaultdict(set)
    per_key: dict[bytes, list[tuple[int, str, bool]]] = defaultdict(list)
    unordered = []
    for number, path in enumerate(files):
        rows = pq.read_table(path).to_pylist()
        keys_in_file = [row["key"] for row in rows if row["key"] is not None]
        # contiguous: once a key's run ends in a file, the key does not come back
        runs = [key for i, key in enumerate(keys_in_file) if i == 0 or keys_in_file[i - 1] != key]
        assert len(runs) == len(set(runs)), f"a key's messages are split up in {path.name}"
        for row in rows:
            if row["key"] is None:
                unordered.append(row["message_id"])
                continue
            file_of[row["key"]].add(number)
            per_key[row["key"]].append((row["key_sequence"], row["message_id"], row["order_undefined"]))
    assert all(len(found) == 1 for found in file_of.values())
    assert set(per_key) == set(work.truth)
    for key, rows in per_key.items():
        assert [sequence for sequence, _, _ in rows] == list(range(1, len(rows) + 1)), key
        assert all(undefined == (key == b"split") for _, _, undefined in rows), key
        if key != b"split":
            assert [message_id for _, message_id, _ in rows] == work.truth[key], key
    assert sorted(unordered) == sorted(work.unordered)
