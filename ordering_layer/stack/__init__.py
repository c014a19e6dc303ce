"""Local Kafka + Redis for the demo, the tests and the benchmarks, behind one backend seam; a Spark
standalone cluster beside them on request."""

from __future__ import annotations

import os
from pathlib import Path

from ordering_layer.errors import ConfigError
from ordering_layer.stack.base import Endpoints, StackBackend
from ordering_layer.stack.containers import ContainerStack
from ordering_layer.stack.local import LocalStack
from ordering_layer.stack.spark_cluster import SparkCluster

__all__ = ["ContainerStack", "Endpoints", "LocalStack", "SparkCluster", "StackBackend", "get_backend"]

BACKENDS = ("local", "testcontainers")


def get_backend(kind: str | None = None, state_dir: Path | None = None, *, redis_cluster: bool | None = None,
                secure: bool | None = None) -> StackBackend:
    """The stack backend named by ``kind`` or ``$ORDERING_LAYER_STACK`` (default ``local``).

    ``local`` runs Kafka and Redis as processes of this machine; ``testcontainers`` runs them in
    containers (see ``ordering_layer.stack.containers``). ``redis_cluster`` and ``secure`` choose
    the local stack's variant (see ``LocalStack``; None: as started, else the environment).

    Raises:
        ConfigError: an unknown backend, or a variant the container backend does not offer.
    """
    kind = kind or os.environ.get("ORDERING_LAYER_STACK", "local")
    if kind == "local":
        return LocalStack(state_dir, redis_cluster=redis_cluster, secure=secure)
    if kind == "testcontainers":
        if redis_cluster or secure:
            raise ConfigError("the testcontainers backend runs a plain Kafka and one Redis; "
                              "use the local backend for --redis-cluster and --secure")
        return ContainerStack(state_dir)
    raise ConfigError(f"unknown stack backend {kind!r}; known: {', '.join(BACKENDS)}")
