"""``ordering-layer push SUBSCRIPTION``: run the pusher of a push subscription until SIGTERM or Ctrl-C."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import click

from ordering_layer.errors import OrderingLayerError
from ordering_layer.push.pusher import Pusher


@contextlib.contextmanager
def _stopping_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGINT and SIGTERM set ``stop`` (instead of ending the process) while inside."""
    previous = {signum: signal.signal(signum, lambda *_: stop.set()) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def push_command(server_options: Callable[[Any], Any]) -> click.Command:
    """The ``push`` command, with the main CLI's server options (``--bootstrap``, ``--redis-url``,
    ``--kafka-config``) passed in, as ``prober_command`` takes them."""

    def push(subscription_name: str, metrics_port: int | None, stop_timeout: float, servers: Any) -> None:
        """Push the messages of SUBSCRIPTION_NAME to its endpoint until Ctrl-C or SIGTERM (PSH-1..3).

        Several pushers of one subscription share its partitions. On SIGTERM the requests in flight
        finish (their answers ack or nack), the messages not sent yet are nacked, the acks are
        committed and the group is left; kill -9 loses nothing either (the leases lapse).
        """
        endpoints = servers.endpoints()
        if not endpoints.redis_url:
            raise click.ClickException("push needs Redis: --redis-url or $ORDERING_LAYER_REDIS_URL")
        stop = threading.Event()
        with _stopping_on_signals(stop):
            try:
                pusher = Pusher(endpoints.kafka_config(), subscription_name, redis_url=endpoints.redis_url,
                                metrics_port=metrics_port).start()
            except OrderingLayerError as exc:
                raise click.ClickException(str(exc)) from exc
            click.echo(f"pushing {subscription_name} to {pusher.push_endpoint}; stop with Ctrl-C or SIGTERM", err=True)
            try:
                # A timed wait: the signal handler runs on this thread between waits.
                while not stop.wait(0.5):
                    pass
            finally:
                pusher.close(stop_timeout)
        click.echo(f"pusher of {subscription_name} stopped", err=True)

    command: Any = server_options(push)
    command = click.option("--stop-timeout", type=float, default=30.0, show_default=True,
                           help="Seconds a stop waits for the requests in flight and the group leave.")(command)
    command = click.option("--metrics-port", type=int, default=None,
                           help="Serve Prometheus metrics on this port (0: a free one).")(command)
    command = click.argument("subscription_name")(command)
    return click.command("push")(command)
