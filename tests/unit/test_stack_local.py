"""The local backend's cluster layout, without starting a JVM: ports, ids, broker settings, the
storage tool's quorum arguments, and the refusals that come before any process starts."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from ordering_layer.errors import StackError
from ordering_layer.stack import ContainerStack, LocalStack
from ordering_layer.stack.base import BROKER_SETTINGS, ephemeral_ports, free_port
from ordering_layer.stack.local import broker_properties, kafka_uuid, new_state, quorum_arguments


def test_cluster_state_gives_each_broker_its_own_ports_and_ids() -> None:
    state = new_state(3)
    nodes = state["nodes"]
    assert [n["node"] for n in nodes] == [1, 2, 3]
    ports = [n["port"] for n in nodes] + [n["controller_port"] for n in nodes] + [state["redis_port"]]
    assert len(set(ports)) == 7
    assert len({n["directory_id"] for n in nodes}) == 3
    assert state["brokers"] == 3


def test_service_ports_lie_below_the_ephemeral_range() -> None:
    """A restarted broker or Redis listens on its port again: its port is never one the kernel may
    give an outgoing connection meanwhile (the restart would fail with "address in use")."""
    ephemeral = ephemeral_ports()
    if ephemeral is None:
        pytest.skip("the kernel's ephemeral port range is not readable here")
    ports = [free_port() for _ in range(50)]
    assert not any(port in ephemeral for port in ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", ports[0]))  # free when given


def test_cluster_nodes_share_one_quorum_and_replicate_every_topic(tmp_path: Path) -> None:
    state = new_state(3)
    props = broker_properties(state, state["nodes"][1], tmp_path / "data")
    controllers = [f"127.0.0.1:{n['controller_port']}" for n in state["nodes"]]
    assert props["node.id"] == "2"
    assert props["controller.quorum.bootstrap.servers"].split(",") == controllers
    assert props["listeners"] == (f"PLAINTEXT://127.0.0.1:{state['nodes'][1]['port']},"
                                  f"CONTROLLER://{controllers[1]}")
    assert "controller.quorum.voters" not in props  # a dynamic quorum, as the storage tool formats it
    assert props["offsets.topic.replication.factor"] == "3"
    assert props["transaction.state.log.min.isr"] == "2"
    assert props["default.replication.factor"] == "3" and props["min.insync.replicas"] == "2"
    voters = quorum_arguments(state)
    assert voters[0] == "--initial-controllers"
    assert voters[1].split(",") == [f"{n['node']}@127.0.0.1:{n['controller_port']}:{n['directory_id']}"
                                    for n in state["nodes"]]


def test_single_node_keeps_the_single_node_settings(tmp_path: Path) -> None:
    state = new_state(1)
    props = broker_properties(state, state["nodes"][0], tmp_path / "data")
    assert props["node.id"] == "1"
    assert {k: props[k] for k in BROKER_SETTINGS} == BROKER_SETTINGS
    assert "min.insync.replicas" not in props
    assert quorum_arguments(state) == ["--standalone"]


def test_kafka_uuids_have_kafkas_form() -> None:
    ids = {kafka_uuid() for _ in range(2000)}
    assert len(ids) == 2000
    assert all(len(i) == 22 and not i.startswith("-") for i in ids)


def test_refusals_come_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(StackError, match="1 broker or a 3-broker cluster, not 2"):
        new_state(2)
    with pytest.raises(StackError, match="a secured stack runs one broker"):
        new_state(3, secure=True)
    with pytest.raises(StackError, match="a secured stack runs one broker"):
        LocalStack(tmp_path / "secure", secure=True).up(brokers=3)
    stack = LocalStack(tmp_path)
    stack._save(new_state(1))
    with pytest.raises(StackError, match="holds a stack of 1 broker"):
        stack.up(brokers=3)
    stack._save(new_state(3))
    with pytest.raises(StackError, match=r"no broker 4: this stack has broker\(s\) 1..3"):
        stack.stop_broker(node=4, kill=True)
    stack._save({"kafka_port": 9092, "kafka_pid": None})
    with pytest.raises(StackError, match="no broker list"):
        stack.down()
    containers = ContainerStack(tmp_path / "containers")
    with pytest.raises(StackError, match="runs a single broker"):
        containers.up(brokers=3)
    with pytest.raises(StackError, match="runs a single broker"):
        containers.stop_broker(node=2)
