"""Redis URLs: single servers and clusters, credentials and TLS options, masking (no server needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from ordering_layer.config import read_kafka_properties
from ordering_layer.errors import ConfigError
from ordering_layer.stack import Endpoints
from ordering_layer.state.client import _cluster_parts, is_cluster_url, mask_url, redis_client


def test_cluster_urls_name_every_startup_node_and_keep_credentials_and_tls_options() -> None:
    """A ``rediss+cluster://`` URL gives the cluster client every listed node, the ACL user and the CA."""
    url = "rediss+cluster://ol:s%40cret@127.0.0.1:7000,localhost:7001/0?ssl_ca_certs=/tmp/ca.pem"
    assert is_cluster_url(url) and not is_cluster_url("rediss://127.0.0.1:7000/0")
    options, nodes = _cluster_parts(url)
    assert nodes == [("127.0.0.1", 7000), ("localhost", 7001)]
    assert options["username"] == "ol" and options["password"] == "s@cret"
    assert options["ssl_ca_certs"] == "/tmp/ca.pem"
    assert options["ssl"] is True
    assert "host" not in options and "db" not in options


@pytest.mark.parametrize("url", ["redis+cluster://127.0.0.1:7000/3", "redis+cluster://127.0.0.1/0",
                                 "redis+cluster://127.0.0.1:7000,:7001/"])
def test_malformed_cluster_urls_are_refused_without_their_password(url: str) -> None:
    """A cluster has database 0 only, and every node needs host:port."""
    with pytest.raises(ConfigError) as raised:
        _cluster_parts(url.replace("://", "://u:hidden@"))
    assert "hidden" not in str(raised.value)


def test_redis_client_picks_the_client_class_by_url() -> None:
    """A plain URL makes ``redis.Redis`` with the layer's retry policy; no server is contacted."""
    client = redis_client("redis://u:pw@127.0.0.1:1/2")
    assert type(client) is redis.Redis
    assert client.connection_pool.connection_kwargs["retry"].get_retries() == 5
    assert ":pw" not in repr(client)


def test_mask_url_hides_only_the_password() -> None:
    """Printed URLs and reprs keep user, hosts and options, never the password."""
    assert mask_url("rediss://ol:pa55@h:1/0?ssl_ca_certs=/x") == "rediss://ol:***@h:1/0?ssl_ca_certs=/x"
    assert mask_url("redis+cluster://:pa55@h:1,h:2/") == "redis+cluster://:***@h:1,h:2/"
    assert mask_url("redis://h:1/0") == "redis://h:1/0"
    endpoints = Endpoints("b:1", "rediss://ol:pa55@h:1/0")
    assert "pa55" not in repr(endpoints) and "pa55" not in str(endpoints)


def test_kafka_properties_file(tmp_path: Path) -> None:
    """Client settings files: key=value lines, comments, and errors that do not echo the line."""
    path = tmp_path / "client.properties"
    path.write_text("# comment\nsecurity.protocol=SASL_SSL\n\nsasl.password = a=b\n")
    assert read_kafka_properties(path) == {"security.protocol": "SASL_SSL", "sasl.password": "a=b"}
    assert Endpoints("b:1", "", str(path)).kafka_config()["bootstrap.servers"] == "b:1"
    path.write_text("sasl.password hidden\n")
    with pytest.raises(ConfigError, match=r"client\.properties:1") as raised:
        read_kafka_properties(path)
    assert "hidden" not in str(raised.value)
