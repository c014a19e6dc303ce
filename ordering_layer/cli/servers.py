"""What the commands share: the server options, their resolution to endpoints, and plain tables."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import click

from ordering_layer.errors import OrderingLayerError
from ordering_layer.stack import Endpoints, get_backend
from ordering_layer.state.client import mask_url

ENV_BOOTSTRAP = "ORDERING_LAYER_BOOTSTRAP"
ENV_REDIS = "ORDERING_LAYER_REDIS_URL"
ENV_KAFKA_CONFIG = "ORDERING_LAYER_KAFKA_CONFIG"


@dataclass(frozen=True)
class ServerOptions:
    """The server options of a command, resolved to endpoints on demand."""

    bootstrap: str | None
    redis_url: str | None
    kafka_config: str | None

    def __repr__(self) -> str:
        return f"ServerOptions({self.bootstrap!r}, {mask_url(self.redis_url or '')!r}, {self.kafka_config!r})"

    def endpoints(self) -> Endpoints:
        """See ``resolve_endpoints``."""
        return resolve_endpoints(self.bootstrap, self.redis_url, self.kafka_config)


def server_options(command: Any) -> Any:
    """Adds --bootstrap, --kafka-config and --redis-url; the command gets them as ``servers``."""

    @functools.wraps(command)
    def with_servers(*args: Any, bootstrap: str | None, redis_url: str | None, kafka_config: str | None,
                     **kwargs: Any) -> Any:
        return command(*args, servers=ServerOptions(bootstrap, redis_url, kafka_config), **kwargs)

    func: Any = with_servers
    func = click.option("--bootstrap", envvar=ENV_BOOTSTRAP, default=None,
                        help=f"Kafka bootstrap servers (default: ${ENV_BOOTSTRAP}, then the local stack).")(func)
    func = click.option("--kafka-config", envvar=ENV_KAFKA_CONFIG, default=None,
                        type=click.Path(exists=True, dir_okay=False),
                        help="Properties file of further Kafka client settings (security.protocol, sasl.*, "
                             f"ssl.*; default: ${ENV_KAFKA_CONFIG}, then the local stack's).")(func)
    return click.option("--redis-url", envvar=ENV_REDIS, default=None,
                        help=f"Redis URL (default: ${ENV_REDIS}, then the local stack).")(func)


def resolve_endpoints(bootstrap: str | None, redis_url: str | None, kafka_config: str | None = None) -> Endpoints:
    """Explicit addresses, else the environment, else the running local stack."""
    if bootstrap and redis_url:
        return Endpoints(bootstrap, redis_url, kafka_config or "")
    try:
        local = get_backend().endpoints()
    except OrderingLayerError as exc:
        if bootstrap:
            return Endpoints(bootstrap, redis_url or "", kafka_config or "")
        raise click.ClickException(
            f"no servers named (--bootstrap/--redis-url or ${ENV_BOOTSTRAP}/${ENV_REDIS}) and {exc}") from exc
    if bootstrap:
        return Endpoints(bootstrap, redis_url or local.redis_url, kafka_config or "")
    return Endpoints(local.bootstrap, redis_url or local.redis_url, kafka_config or local.kafka_config_file)


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain text table: a header line, a rule, and left-aligned columns."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines.extend("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)
    return "\n".join(lines)
