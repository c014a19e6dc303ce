"""The container backend's broker configuration, through the Kafka image's own entrypoint.

``kafka_environment`` names broker settings as ``KAFKA_*`` variables (the apache/kafka convention);
``docker/kafka/entrypoint.sh`` turns them back into ``server.properties``. Running the entrypoint
with a stand-in ``java`` checks that both sides agree, without Docker.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ordering_layer.stack.base import BROKER_SETTINGS
from ordering_layer.stack.containers import kafka_environment, local_images, official_images
from ordering_layer.stack.jars import kafka_version

ENTRYPOINT = Path(__file__).resolve().parents[2] / "docker" / "kafka" / "entrypoint.sh"

FAKE_JAVA = """#!/bin/sh
# Records each call; 'format' creates meta.properties like the real StorageTool.
echo "$@" >> "$CALLS"
case "$*" in *StorageTool*) mkdir -p "$LOG_DIR" && touch "$LOG_DIR/meta.properties";; esac
"""


def run_entrypoint(tmp_path: Path, env: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    java = bin_dir / "java"
    java.write_text(FAKE_JAVA)
    java.chmod(0o755)
    config = tmp_path / "server.properties"
    calls = tmp_path / "calls"
    full_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls),
                "LOG_DIR": env["KAFKA_LOG_DIRS"], "KAFKA_SERVER_PROPERTIES": str(config), **env}
    subprocess.run(["bash", str(ENTRYPOINT)], env=full_env, check=True, timeout=30)
    props = dict(line.split("=", 1) for line in config.read_text().splitlines())
    return props, calls.read_text().splitlines()


def test_entrypoint_reads_the_backend_environment(tmp_path: Path) -> None:
    env = kafka_environment("127.0.0.1", 41234)
    env["KAFKA_LOG_DIRS"] = str(tmp_path / "data")
    props, calls = run_entrypoint(tmp_path, env)
    assert props["listeners"] == "PLAINTEXT://0.0.0.0:41234,CONTROLLER://localhost:9093"
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:41234"
    assert props["controller.quorum.voters"] == "1@localhost:9093"
    assert props["log.dirs"] == str(tmp_path / "data")
    for key, value in BROKER_SETTINGS.items():
        assert props[key] == value, key
    # Launcher variables are JVM options, not broker settings.
    assert not any(key.startswith(("heap", "server")) for key in props)
    assert len(calls) == 2 and "StorageTool format" in calls[0] and "-t 5L6g3nShT-eMCtK--X86sw" in calls[0]
    assert calls[1].startswith("-Xmx512m -Xms256m") and calls[1].endswith(f"kafka.Kafka {tmp_path}/server.properties")

    # A second start finds the formatted log folder and only runs the broker.
    _, calls = run_entrypoint(tmp_path, env)
    assert len(calls) == 3 and "StorageTool" not in calls[2]


def test_entrypoint_name_mangling_follows_apache_kafka(tmp_path: Path) -> None:
    """'___' -> '-', '__' -> '_', '_' -> '.', as the official image documents."""
    env = {"KAFKA_LOG_DIRS": str(tmp_path / "d"), "KAFKA_SOME___DASHED": "1",
           "KAFKA_WITH__UNDERSCORE_NAME": "2", "NOT_KAFKA": "3"}
    props, _ = run_entrypoint(tmp_path, env)
    assert props["some-dashed"] == "1"
    assert props["with_underscore.name"] == "2"
    assert "not.kafka" not in props and "kafka" not in " ".join(props)
    assert props["process.roles"] == "broker,controller"  # defaults stay for what is not named


def test_image_names_follow_the_pinned_kafka_version() -> None:
    assert local_images()["kafka"] == f"ordering-layer/kafka:{kafka_version()}"
    assert official_images() == {"kafka": f"apache/kafka:{kafka_version()}", "redis": "redis:7"}
