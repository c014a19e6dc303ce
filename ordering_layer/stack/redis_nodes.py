"""Debian's redis-server as local processes: one server, or a Redis Cluster of several masters.

Each node runs from its own config file (``appendonly yes``; a cluster node also keeps
``nodes.conf``), so a node killed and started again comes back with its data and, in a cluster, its
identity and slots. A cluster is formed once, in Python: each node takes a third of the slots
(``CLUSTER ADDSLOTSRANGE``), gets a distinct config epoch, and meets the first node. Optionally the
nodes speak TLS only (``port 0``, ``tls-port``, TLS on the cluster bus too) and accept one ACL user
with a password, the default user being disabled. Ports, pids and whether the cluster was formed are
kept in ``<folder>/nodes.json`` so that a later CLI call finds the processes.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import redis

from ordering_layer.errors import StackError
from ordering_layer.stack.base import free_port
from ordering_layer.stack.certs import TlsFiles
from ordering_layer.stack.processes import START_TIMEOUT, alive, spawn, stop, wait_until, write_private
from ordering_layer.state.client import redis_client

_LOGGER = logging.getLogger(__name__)

_SLOTS = 16384
# Short, so that the other masters declare a killed one failed within seconds (the restart tests
# see the cluster go down and come back); long enough for a busy 2-core machine.
_NODE_TIMEOUT_MS = 3000


@dataclass(frozen=True)
class RedisAccess:
    """How clients reach the nodes: TLS (``tls``) and an ACL user (``username``/``password``), both optional."""

    tls: TlsFiles | None = None
    username: str | None = None
    password: str | None = None

    def __repr__(self) -> str:
        return f"RedisAccess(tls={self.tls is not None}, username={self.username!r})"


class RedisNodes:
    """One redis-server (``count=1``) or a cluster of ``count`` masters, as processes in ``folder``.

    Args:
        folder: config, data and logs of every node, and ``nodes.json``.
        count: number of servers (masters, for a cluster).
        cluster: run them as one Redis Cluster.
        access: TLS and ACL user, if any.
        ports: the client port of each node on the first start (default: free ports); later starts
            reuse the ports kept in ``nodes.json``.
    """

    def __init__(self, folder: Path, *, count: int = 1, cluster: bool = False,
                 access: RedisAccess | None = None, ports: list[int] | None = None) -> None:
        if count < 1 or (cluster and count < 3):
            raise StackError(f"a Redis Cluster needs 3 masters or more, a plain Redis 1 node; got {count}")
        if ports is not None and len(ports) != count:
            raise StackError(f"{count} Redis node(s) need {count} port(s), got {len(ports)}")
        self.folder = folder
        self.count = count
        self.cluster = cluster
        self.access = access or RedisAccess()
        self._state_file = folder / "nodes.json"
        self._first_ports = ports

    # -- state -----------------------------------------------------------------------------------
    def _load(self) -> dict[str, Any]:
        if self._state_file.exists():
            loaded: dict[str, Any] = json.loads(self._state_file.read_text())
            return loaded
        ports = self._first_ports or [free_port() for _ in range(self.count)]
        state = {"ports": list(ports), "pids": [None] * self.count, "formed": False}
        # The cluster bus gets a port of its own: port + 10000 (Redis' default) may be taken.
        state["bus_ports"] = [free_port() for _ in range(self.count)] if self.cluster else []
        self._save(state)
        return state

    def _save(self, state: dict[str, Any]) -> None:
        write_private(self._state_file, json.dumps(state, indent=2))

    # -- addresses -------------------------------------------------------------------------------
    def _url(self, hosts: str, *, cluster: bool) -> str:
        scheme = ("rediss" if self.access.tls else "redis") + ("+cluster" if cluster else "")
        credentials = ""
        if self.access.username is not None:
            credentials = f"{quote(self.access.username, safe='')}:{quote(self.access.password or '', safe='')}@"
        query = f"?ssl_ca_certs={quote(str(self.access.tls.ca))}" if self.access.tls else ""
        return f"{scheme}://{credentials}{hosts}/0{query}"

    def url(self) -> str:
        """The ``redis_url`` of the whole: one server, or the cluster naming every master."""
        ports = self._load()["ports"]
        return self._url(",".join(f"127.0.0.1:{port}" for port in ports), cluster=self.cluster)

    def node_url(self, index: int) -> str:
        """The ``redis_url`` of node ``index`` alone (a plain, non-cluster client of that server)."""
        return self._url(f"127.0.0.1:{self._load()['ports'][index]}", cluster=False)

    def ports(self) -> list[int]:
        """The client port of every node."""
        return list(self._load()["ports"])

    # -- processes -------------------------------------------------------------------------------
    def _config(self, index: int, state: dict[str, Any]) -> Path:
        port = state["ports"][index]
        data = self.folder / f"node-{index}"
        data.mkdir(parents=True, exist_ok=True)
        lines = ["bind 127.0.0.1", f"dir {data}", "appendonly yes", "appendfsync everysec", 'save ""',
                 "daemonize no", "protected-mode no"]
        tls = self.access.tls
        if tls is None:
            lines.append(f"port {port}")
        else:
            lines += ["port 0", f"tls-port {port}", f"tls-cert-file {tls.cert}", f"tls-key-file {tls.key}",
                      f"tls-ca-cert-file {tls.ca}", "tls-auth-clients no"]
        if self.cluster:
            lines += ["cluster-enabled yes", "cluster-config-file nodes.conf",
                      f"cluster-port {state['bus_ports'][index]}", f"cluster-node-timeout {_NODE_TIMEOUT_MS}"]
            if tls is not None:
                lines += ["tls-cluster yes"]
        if self.access.username is not None:
            lines += ["user default off", f"user {self.access.username} on >{self.access.password} ~* &* +@all"]
        config = self.folder / f"node-{index}.conf"
        write_private(config, "\n".join(lines) + "\n")
        return config

    def node_client(self, index: int) -> redis.Redis[bytes]:
        """A plain client of node ``index`` alone (close it after use)."""
        client = redis_client(self.node_url(index))
        assert isinstance(client, redis.Redis)
        return client

    def start_node(self, index: int) -> None:
        """Start node ``index`` (unless it runs) and wait until it answers PING."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise StackError("redis-server not found: apt-get install -y redis-server (or run 'make setup')")
        state = self._load()
        if alive(state["pids"][index]):
            return
        log = self.folder / f"node-{index}.log"
        pid = spawn([binary, str(self._config(index, state))], log)
        state["pids"][index] = pid
        self._save(state)
        client = self.node_client(index)
        try:
            wait_until(client.ping, f"redis-server {index}", pid, log)
        finally:
            client.close()

    def stop_node(self, index: int, *, kill: bool = False) -> None:
        """Stop node ``index`` (SIGKILL when ``kill``), keeping its data and cluster identity."""
        state = self._load()
        stop(state["pids"][index], kill=kill)
        state["pids"][index] = None
        self._save(state)

    def up(self) -> None:
        """Start every stopped node; form the cluster the first time; wait until it serves every slot."""
        for index in range(self.count):
            self.start_node(index)
        if self.cluster:
            if not self._load()["formed"]:
                self._form()
            self.wait_cluster_ok()

    def stop(self, *, kill: bool = False) -> None:
        """Stop every node, keeping the data."""
        for index in range(self.count):
            self.stop_node(index, kill=kill)

    def running(self) -> list[bool]:
        """Whether each node's process runs."""
        return [alive(pid) for pid in self._load()["pids"]]

    def pids(self) -> list[int | None]:
        """The process id of each node (None when stopped)."""
        return list(self._load()["pids"])

    # -- cluster ---------------------------------------------------------------------------------
    def _form(self) -> None:
        state = self._load()
        per_node = _SLOTS // self.count
        clients = [self.node_client(i) for i in range(self.count)]
        try:
            for index, client in enumerate(clients):
                first = index * per_node
                last = _SLOTS - 1 if index == self.count - 1 else first + per_node - 1
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
                # Distinct epochs, as redis-cli --cluster create sets them, so no two masters start
                # from the same one and slot ownership needs no collision handling.
                client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", index + 1)
            for index in range(1, self.count):
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", state["ports"][index],
                                           state["bus_ports"][index])
        finally:
            for client in clients:
                client.close()
        state["formed"] = True
        self._save(state)
        _LOGGER.info("Redis Cluster formed: %d masters on ports %s", self.count, state["ports"])

    def _cluster_info(self, index: int) -> dict[str, str]:
        client = self.node_client(index)
        try:
            info = client.execute_command("CLUSTER", "INFO")
        finally:
            client.close()
        text = info.decode() if isinstance(info, bytes) else str(info)
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def cluster_ok(self) -> bool:
        """True when every node runs, reports ``cluster_state:ok`` and knows every master."""
        return all(self.running()) and all(
            info.get("cluster_state") == "ok" and int(info.get("cluster_size", 0)) == self.count
            for info in (self._cluster_info(index) for index in range(self.count)))

    def wait_cluster_ok(self, timeout: float = START_TIMEOUT) -> None:
        """Wait until the cluster serves every slot again (after a start or a node's restart).

        Raises:
            StackError: not within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.cluster_ok():
                    return
            except Exception as exc:  # noqa: BLE001 - a node still starting answers with errors
                _LOGGER.debug("cluster not ready: %s", exc)
            time.sleep(0.2)
        raise StackError(f"Redis Cluster in {self.folder} not ok within {timeout:.0f} s; see node-*.log there")

    def cluster_failed(self) -> bool:
        """True when a running node reports ``cluster_state:fail`` (it considers a master down)."""
        return any(running and self._cluster_info(index).get("cluster_state") == "fail"
                   for index, running in enumerate(self.running()))

    def node_of(self, key: str) -> int:
        """The index of the node serving ``key``'s slot."""
        client = self.node_client(0)
        try:
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
        finally:
            client.close()
        per_node = _SLOTS // self.count
        return min(slot // per_node, self.count - 1)
