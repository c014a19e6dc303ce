"""A Spark standalone cluster from the installed pyspark: one master and one worker as local processes.

pyspark from PyPI carries Spark's jars and ``bin/spark-class`` (not ``sbin/start-master.sh`` and
``sbin/start-worker.sh``), which runs the master and worker classes just as those scripts do. Both
bind 127.0.0.1 on free ports; the master's REST submission server, which would take the fixed port
6066, is off. The worker starts executors from the same installation (``SPARK_HOME``) in its
``work/`` folder. ``SPARK_CONF_DIR`` is a ``conf/`` folder of this cluster's own, so a Spark
configuration elsewhere on the machine does not change it. Ports and pids are kept in
``<folder>/cluster.json`` so that a later CLI call finds the processes.

Jobs reach it with ``spark-submit --master spark://127.0.0.1:<port>``: the driver runs where
``spark-submit`` runs, ``--jars`` (or ``spark.jars``) ships the Kafka source to the executors, and
the driver's ``PYSPARK_PYTHON`` is the interpreter the executors start for Python code.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import urllib.request
from pathlib import Path
from typing import Any

from ordering_layer.errors import StackError
from ordering_layer.stack.base import free_port
from ordering_layer.stack.processes import alive, spawn, stop, wait_until, write_private

_LOGGER = logging.getLogger(__name__)

_HOST = "127.0.0.1"
_MASTER_CLASS = "org.apache.spark.deploy.master.Master"
_WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
# Loopback only: no proxy from the environment may stand between this process and the master's UI.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def spark_home() -> Path:
    """The installed pyspark's folder, which is a Spark installation (``jars/``, ``bin/``).

    Raises:
        StackError: pyspark is not installed.
    """
    spec = importlib.util.find_spec("pyspark")
    if spec is None or spec.origin is None:
        raise StackError("pyspark is not installed: pip install 'ordering-layer[spark]'")
    return Path(spec.origin).parent


def read_master_state(ui_url: str) -> dict[str, Any]:
    """A standalone master's own account of itself, from its web UI at ``ui_url`` (its ``/json``:
    ``status``, ``workers``, ``activeapps``, ``completedapps``, ...).

    Raises:
        OSError: the master does not answer.
    """
    with _DIRECT.open(f"{ui_url.rstrip('/')}/json", timeout=2) as answer:
        parsed: dict[str, Any] = json.load(answer)
        return parsed


def spark_submit() -> Path:
    """``bin/spark-submit`` of the installed pyspark. Raises ``StackError`` when pyspark is missing."""
    return spark_home() / "bin" / "spark-submit"


class SparkCluster:
    """A Spark master and one worker in ``folder``.

    Args:
        folder: logs, the worker's ``work/`` folder, ``conf/`` and ``cluster.json``.
        cores: cores the worker offers to executors.
        memory: memory the worker offers to executors (Spark's size syntax, e.g. ``1g``); an
            application asking more per executor (``spark.executor.memory``, default 1g) gets none.
        daemon_memory: heap of the master and of the worker process each (``SPARK_DAEMON_MEMORY``).
    """

    def __init__(self, folder: Path, *, cores: int = 1, memory: str = "1g", daemon_memory: str = "512m") -> None:
        if cores < 1:
            raise StackError(f"a Spark worker needs 1 core or more, got {cores}")
        self.folder = folder
        self.cores = cores
        self.memory = memory
        self.daemon_memory = daemon_memory
        self._state_file = folder / "cluster.json"

    # -- state -----------------------------------------------------------------------------------
    def _load(self) -> dict[str, Any]:
        if self._state_file.exists():
            loaded: dict[str, Any] = json.loads(self._state_file.read_text())
            return loaded
        ports: list[int] = []
        while len(ports) < 4:
            port = free_port()
            if port not in ports:
                ports.append(port)
        state = {"master_port": ports[0], "master_ui_port": ports[1], "worker_port": ports[2],
                 "worker_ui_port": ports[3], "master_pid": None, "worker_pid": None}
        self._save(state)
        return state

    def _save(self, state: dict[str, Any]) -> None:
        write_private(self._state_file, json.dumps(state, indent=2))

    # -- addresses -------------------------------------------------------------------------------
    def master_url(self) -> str:
        """``spark://127.0.0.1:<port>``: what ``spark-submit --master`` and ``SparkSession.builder.master`` take."""
        return f"spark://{_HOST}:{self._load()['master_port']}"

    def ui_url(self) -> str:
        """The master's web UI (``/json`` gives its state as JSON)."""
        return f"http://{_HOST}:{self._load()['master_ui_port']}"

    def pids(self) -> list[int | None]:
        """The master's and the worker's process ids (None: not started)."""
        state = self._load()
        return [state["master_pid"], state["worker_pid"]]

    def running(self) -> bool:
        """True when the master and the worker processes run."""
        return all(alive(pid) for pid in self.pids())

    def master_state(self) -> dict[str, Any]:
        """``read_master_state`` of this cluster's master. Raises ``OSError`` when it does not answer."""
        return read_master_state(self.ui_url())

    # -- processes -------------------------------------------------------------------------------
    def _environment(self) -> dict[str, str]:
        home = spark_home()
        conf = self.folder / "conf"
        conf.mkdir(parents=True, exist_ok=True)
        env = {name: value for name, value in os.environ.items() if name != "SPARK_ENV_LOADED"}
        env.update({
            "SPARK_HOME": str(home),
            "SPARK_CONF_DIR": str(conf),
            # Binds the RPC endpoints and the web UIs to loopback (the UIs take 0.0.0.0 otherwise).
            "SPARK_LOCAL_IP": _HOST,
            "SPARK_DAEMON_MEMORY": self.daemon_memory,
            "SPARK_DAEMON_JAVA_OPTS": "-Dspark.master.rest.enabled=false",
        })
        return env

    def _command(self, main_class: str, *args: str) -> list[str]:
        if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
            raise StackError("java not found: Spark 4 needs Java 17 (apt-get install -y openjdk-17-jre-headless)")
        return [str(spark_home() / "bin" / "spark-class"), main_class, *args]

    def up(self) -> str:
        """Start the master and the worker unless they run; wait until the master counts the
        worker alive; return the master URL.

        Raises:
            StackError: pyspark or java is missing, or a process exited or did not answer in time
                (the message names its log).
        """
        state = self._load()
        env = self._environment()
        master_log = self.folder / "master.log"
        if not alive(state["master_pid"]):
            state["master_pid"] = spawn(self._command(
                _MASTER_CLASS, "--host", _HOST, "--port", str(state["master_port"]),
                "--webui-port", str(state["master_ui_port"])), master_log, env)
            self._save(state)
        wait_until(lambda: self.master_state().get("status") == "ALIVE", "Spark master", state["master_pid"],
                   master_log)
        worker_log = self.folder / "worker.log"
        if not alive(state["worker_pid"]):
            work = self.folder / "work"
            work.mkdir(parents=True, exist_ok=True)
            state["worker_pid"] = spawn(self._command(
                _WORKER_CLASS, "--host", _HOST, "--port", str(state["worker_port"]),
                "--webui-port", str(state["worker_ui_port"]), "--cores", str(self.cores), "--memory", self.memory,
                "--work-dir", str(work), self.master_url()), worker_log, env)
            state["worker_offers"] = {"cores": self.cores, "memory": self.memory}
            self._save(state)

        def worker_registered() -> bool:
            return any(worker.get("port") == state["worker_port"] and worker.get("state") == "ALIVE"
                       for worker in self.master_state().get("workers", []))

        wait_until(worker_registered, "Spark worker", state["worker_pid"], worker_log)
        _LOGGER.info("Spark master %s with a worker of %d core(s), %s", self.master_url(), self.cores, self.memory)
        return self.master_url()

    def stop(self, *, kill: bool = False) -> None:
        """Stop the worker (with the executors it started) and the master; SIGKILL when ``kill``.
        Nothing to do when they were never started here."""
        if not self._state_file.exists():
            return
        state = self._load()
        stop(state["worker_pid"], kill=kill, group=True)
        stop(state["master_pid"], kill=kill)
        state["worker_pid"] = state["master_pid"] = None
        self._save(state)

    def status(self) -> dict[str, Any]:
        """Whether both processes run, their pids, the master URL and its UI, what the worker offers."""
        state = self._load()
        return {"running": self.running(), "master": self.master_url(), "ui": self.ui_url(),
                "master_pid": state["master_pid"], "worker_pid": state["worker_pid"],
                "worker_offers": state.get("worker_offers")}
