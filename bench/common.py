"""Shared benchmark plumbing: a stack (the project's launcher, or one named by environment), the
quantile of a sorted sample, a result row."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ordering_layer.stack import Endpoints, get_backend


@contextlib.contextmanager
def bench_stack(*, secure: bool = False) -> Iterator[Endpoints]:
    """Endpoints of ``ORDERING_LAYER_BOOTSTRAP``/``ORDERING_LAYER_REDIS_URL`` (with
    ``ORDERING_LAYER_KAFKA_CONFIG`` for a secured one), else a fresh local stack, secured (TLS and
    authentication on Kafka and Redis) when ``secure``."""
    bootstrap, redis_url = os.environ.get("ORDERING_LAYER_BOOTSTRAP"), os.environ.get("ORDERING_LAYER_REDIS_URL")
    if bootstrap and redis_url:
        yield Endpoints(bootstrap, redis_url, os.environ.get("ORDERING_LAYER_KAFKA_CONFIG", ""))
        return
    with tempfile.TemporaryDirectory(prefix="ol-bench-") as folder:
        backend = get_backend(state_dir=Path(folder), secure=secure or None)
        try:
            yield backend.up()
        finally:
            backend.down()


def ratio_line(name: str, layer: float, raw: float, unit: str = "msg/s") -> str:
    """One printed result row."""
    return f"{name:<44} layer {layer:>12,.0f} {unit}   raw {raw:>12,.0f} {unit}   ratio {layer / raw:5.2f}"


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``values`` (nan when there are none)."""
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")
