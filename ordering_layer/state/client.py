"""The one place that turns a ``redis_url`` into a redis-py client (single server or Redis Cluster).

URL forms (query options such as ``ssl_ca_certs`` are redis-py's, passed through):

- ``redis://[user:password@]host:port/0``: one Redis server; ``rediss://`` for TLS.
- ``redis+cluster://[user:password@]host:port[,host:port...]/`` (``rediss+cluster://`` for TLS): a
  Redis Cluster, discovered from the listed nodes (more than one lets a client start while one is
  down). A cluster has one database, 0.

Every client gets the same retry policy. ``verify_redis`` checks credentials and certificates once,
so that a wrong password or CA fails fast with ``AuthenticationError(server="redis")``.
"""

from __future__ import annotations

import logging
import ssl
from typing import Any, TypeAlias, Union
from urllib.parse import quote, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url
from redis.retry import Retry

from ordering_layer.errors import AuthenticationError, ConfigError

_LOGGER = logging.getLogger(__name__)

_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_TIMEOUT = 5.0  # seconds, for connecting and for each answer

# Quoted: the type stubs make both classes generic, the runtime classes are not.
RedisClient: TypeAlias = Union["redis.Redis[bytes]", "RedisCluster[bytes]"]


def retry_policy() -> Retry:
    """The layer's retry policy for Redis: 5 retries, exponential backoff from 50 ms to 2 s, on
    connection and timeout errors and on a cluster that is down (a master failed or restarting).

    A single server's client applies it itself; redis-py's cluster client counts its retries but
    does not wait between them, so the state store applies it around cluster calls.
    """
    return Retry(ExponentialBackoff(cap=2.0, base=0.05), retries=5,
                 supported_errors=(redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterDownError))


def is_cluster_url(url: str) -> bool:
    """True when ``url`` names a Redis Cluster (``redis+cluster://`` or ``rediss+cluster://``)."""
    return urlsplit(url).scheme in _CLUSTER_SCHEMES


def _keywords(url: str) -> dict[str, Any]:
    """The ``redis.Redis`` keywords of a single-server URL (TLS as ``ssl=True``, as the cluster
    client builds each node's client from keywords)."""
    options = parse_url(url)
    if options.pop("connection_class", None) is redis.SSLConnection:
        options["ssl"] = True
    return options


def _cluster_parts(url: str) -> tuple[dict[str, Any], list[tuple[str, int]]]:
    """redis-py client options (``redis.Redis`` keywords) and the (host, port) startup nodes of a
    cluster URL."""
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    nodes = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"cluster URL node {item!r} is not host:port (in {mask_url(url)})")
        nodes.append((host, int(port)))
    first = f"{userinfo}@{hosts.split(',')[0]}" if userinfo else hosts.split(",")[0]
    options = _keywords(urlunsplit((_CLUSTER_SCHEMES[parts.scheme], first, "", parts.query, "")))
    if options.pop("db", 0) != 0:
        raise ConfigError(f"a Redis Cluster has database 0 only (in {mask_url(url)})")
    if parts.path.strip("/") not in ("", "0"):
        raise ConfigError(f"a Redis Cluster has database 0 only (in {mask_url(url)})")
    options.pop("host", None)
    options.pop("port", None)
    return options, nodes


def redis_client(url: str) -> RedisClient:
    """A redis-py client for ``url``: ``RedisCluster`` for a cluster URL, else ``Redis``.

    Args:
        url: see the module docstring for the forms.

    Raises:
        ConfigError: the URL is malformed.
        redis.RedisError: a cluster URL's nodes cannot be reached (the cluster client reads the slot
            map at construction).
    """
    if not is_cluster_url(url):
        try:
            return redis.Redis.from_url(url, retry=retry_policy(), socket_timeout=_TIMEOUT,
                                        socket_connect_timeout=_TIMEOUT,
                                        retry_on_error=[redis.ConnectionError, redis.TimeoutError])
        except ValueError as exc:
            raise ConfigError(f"bad Redis URL {mask_url(url)}: {exc}") from exc
    options, nodes = _cluster_parts(url)
    try:
        return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in nodes], retry=retry_policy(),
                            socket_timeout=_TIMEOUT, socket_connect_timeout=_TIMEOUT, **options)
    except redis.exceptions.RedisClusterException as exc:
        raise redis.exceptions.ClusterDownError(f"Redis Cluster {mask_url(url)}: {exc}") from exc


def _probe_clients(url: str) -> list[tuple[str, redis.Redis[bytes]]]:
    """One client per server named by ``url``, without retries, for a quick check."""
    if is_cluster_url(url):
        options, nodes = _cluster_parts(url)
    else:
        options = _keywords(url)
        nodes = [(options.pop("host", "localhost"), int(options.pop("port", 6379)))]
    options.update(socket_timeout=_TIMEOUT, socket_connect_timeout=_TIMEOUT, retry=Retry(NoBackoff(), 0))
    return [(f"{host}:{port}", redis.Redis(host=host, port=port, **options)) for host, port in nodes]


def verify_redis(url: str) -> None:
    """Check that a server of ``url`` accepts our credentials and that its certificate is trusted.

    A server that does not answer is left to the caller's later commands (and their retries).

    Raises:
        AuthenticationError: a server refused the user or password, or TLS failed (wrong CA, plain
            client on a TLS port).
    """
    for address, client in _probe_clients(url):
        try:
            client.ping()
            return
        except (redis.AuthenticationError, redis.exceptions.AuthorizationError,
                redis.exceptions.AuthenticationWrongNumberOfArgsError, redis.exceptions.NoPermissionError) as exc:
            raise AuthenticationError(f"Redis at {address} refused the credentials of {mask_url(url)}: {exc}",
                                      server="redis") from None
        except redis.ConnectionError as exc:
            if _is_tls_failure(exc):
                raise AuthenticationError(f"Redis at {address}: TLS handshake failed for {mask_url(url)}: {exc}",
                                          server="redis") from None
            _LOGGER.debug("Redis at %s does not answer yet: %s", address, exc)
        finally:
            client.close()


def _is_tls_failure(exc: BaseException) -> bool:
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ssl.SSLError):
            return True
        cause = cause.__cause__ or cause.__context__
    text = str(exc)
    return "SSL" in text or "certificate" in text


def mask_url(url: str) -> str:
    """``url`` with its password replaced by ``***``, for logs, errors and printed endpoints."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return urlunsplit((parts.scheme, f"{user}:***@{hosts}", parts.path, parts.query, parts.fragment))


def url_with_credentials(url: str, username: str, password: str) -> str:
    """``url`` carrying ``username`` and ``password`` (percent-encoded) instead of its own."""
    parts = urlsplit(url)
    hosts = parts.netloc.rpartition("@")[2]
    netloc = f"{quote(username, safe='')}:{quote(password, safe='')}@{hosts}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
