"""Prometheus metrics of subscribers and producers (pull model), and an opt-in HTTP endpoint.

``register(engine_or_producer)`` adds a source to the process-wide ``COLLECTOR``, which is in
``prometheus_client``'s default registry, so an application's own exposition shows the layer's
metrics too; ``start_metrics_server(port)`` serves that registry over HTTP. Names and labels: the
README's metrics table, and ``ordering_layer.metrics.names``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, start_http_server

from ordering_layer.errors import ConfigError
from ordering_layer.metrics.collector import LayerCollector

__all__ = ["COLLECTOR", "LayerCollector", "MetricsServer", "register", "start_metrics_server", "unregister"]

_LOGGER = logging.getLogger(__name__)

COLLECTOR = LayerCollector()
_LOCK = threading.Lock()
_registered = False
_servers: dict[int, MetricsServer] = {}  # by port: one endpoint per port, whatever address it binds


def register(source: Any, *, kafka_config: Mapping[str, Any] | None = None) -> None:
    """Export the metrics of a subscriber engine or an ``OrderedProducer``.

    Args:
        source: an engine (``metrics_snapshot()``, ``subscription``, ``topic``) or a producer.
        kafka_config: the engine's Kafka settings; with them the collector also reads the backlog
            of the partitions the engine owns (log end minus committed offset) from Kafka.
    """
    global _registered
    with _LOCK:
        if not _registered:
            REGISTRY.register(COLLECTOR)
            _registered = True
    COLLECTOR.register(source, kafka_config)


def unregister(source: Any) -> None:
    """Stop exporting ``source``'s gauges; its counters so far stay in the totals."""
    COLLECTOR.unregister(source)


class MetricsServer:
    """An HTTP endpoint serving the default registry at ``/metrics`` (``prometheus_client``'s server)."""

    def __init__(self, addr: str, port: int) -> None:
        server: WSGIServer
        server, self._thread = start_http_server(port, addr, REGISTRY)
        self._server = server
        self.addr = addr
        self.port: int = server.server_port

    def close(self) -> None:
        """Stop serving and free the port."""
        with _LOCK:
            _servers.pop(self.port, None)
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)


def start_metrics_server(port: int, addr: str = "0.0.0.0") -> MetricsServer:
    """Serve the metrics on ``http://addr:port/metrics``; a later call for a port this process serves
    already returns that server (every subscriber and producer of a process may ask for the same port).

    Args:
        port: TCP port; 0 picks a free one (read it from the result's ``port``).
        addr: address to bind.

    Raises:
        ConfigError: the port cannot be bound.
    """
    with _LOCK:
        running = _servers.get(port) if port else None
        if running is not None:
            return running
        try:
            server = MetricsServer(addr, port)
        except OSError as exc:
            raise ConfigError(f"metrics endpoint {addr}:{port} cannot be opened: {exc}") from exc
        _servers[server.port] = server
    _LOGGER.info("metrics served on %s:%d", addr, server.port)
    return server
