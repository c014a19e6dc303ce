"""``ordering-layer subscription seek`` and ``ordering-layer snapshot create|list|delete`` (GRP-3).

The seek shows a progress bar (click's own: the CLI's library has one, no further dependency is
needed) of the partitions that have applied it, and a summary line at the end.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import click

from ordering_layer.admin import Admin
from ordering_layer.cli.servers import render_table
from ordering_layer.config import DEFAULT_SNAPSHOT_TOPIC, DEFAULT_SNAPSHOT_TTL
from ordering_layer.errors import OrderingLayerError
from ordering_layer.seek.runner import SeekResult
from ordering_layer.seek.snapshots import Snapshot

AdminFactory = Callable[[Any, str], Admin]  # (server options, snapshot topic) -> Admin
Decorator = Callable[[Any], Any]


def parse_time(text: str) -> datetime:
    """An ISO 8601 time; without a zone it is UTC. Raises ``click.BadParameter``."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError as exc:
        raise click.BadParameter(f"not an ISO 8601 time: {text!r}", param_hint="--time") from exc
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def _snapshot_topic(func: Any) -> Any:
    return click.option("--snapshot-topic", default=DEFAULT_SNAPSHOT_TOPIC, show_default=True,
                        help="The compacted topic that keeps the snapshots.")(func)


def summary(result: SeekResult) -> str:
    """One line on a seek's outcome."""
    total = len(result.partitions)
    return (f"seek {result.generation} of {result.subscription} applied by {total} of {total} partitions "
            f"({result.applied_by_subscribers} by subscribers, {result.applied_by_admin} by the admin); "
            f"rewound {result.rewound} offsets, skipped {result.skipped}")


def snapshot_rows(snapshots: list[Snapshot]) -> list[list[str]]:
    """Table rows of ``snapshot list``."""
    return [[s.name, s.subscription, s.topic, s.created_at.isoformat(timespec="seconds"),
             s.expire_at.isoformat(timespec="seconds"), str(len(s.partitions)), str(s.settled_above)]
            for s in snapshots]


def seek_command(server_options: Decorator, make_admin: AdminFactory) -> click.Command:
    """``subscription seek`` with the CLI's server options."""

    @click.command("seek")
    @click.argument("name")
    @click.option("--time", "at", default=None, help="Seek to this time, ISO 8601 (UTC when no zone is given).")
    @click.option("--snapshot", default=None, help="Seek to this snapshot.")
    @click.option("--timeout", type=float, default=60.0, show_default=True,
                  help="Seconds to wait until every partition has applied the seek.")
    @_snapshot_topic
    @server_options
    def subscription_seek(name: str, at: str | None, snapshot: str | None, timeout: float, snapshot_topic: str,
                          servers: Any) -> None:
        """Seek subscription NAME to --time or --snapshot: messages before count as acked, later ones
        as unacked; every subscriber applies it without restarting."""
        if (at is None) == (snapshot is None):
            raise click.UsageError("give exactly one of --time and --snapshot")
        when = parse_time(at) if at is not None else None
        admin = make_admin(servers, snapshot_topic)
        with click.progressbar(length=1, label="seek recorded, waiting for the partitions", show_eta=False,
                               file=sys.stderr) as bar:

            def progress(applied: int, partitions: int) -> None:
                bar.length = partitions
                bar.label = f"seek applied by {applied} of {partitions} partitions"
                bar.update(applied - bar.pos)

            try:
                result = admin.seek(name, time=when, snapshot=snapshot, timeout=timeout, progress=progress)
            except OrderingLayerError as exc:
                raise click.ClickException(str(exc)) from exc
        click.echo(summary(result))

    return subscription_seek


def snapshot_group(server_options: Decorator, make_admin: AdminFactory) -> click.Group:
    """``snapshot create|list|delete`` with the CLI's server options."""

    @click.group("snapshot")
    def snapshot() -> None:
        """Snapshots of subscriptions' acked state, to seek to later (GRP-3)."""

    @snapshot.command("create")
    @click.argument("name")
    @click.option("--subscription", required=True, help="The subscription whose acked state is kept.")
    @click.option("--ttl", type=click.FloatRange(min=0, min_open=True), default=DEFAULT_SNAPSHOT_TTL,
                  show_default=True, help="Seconds until the snapshot expires.")
    @_snapshot_topic
    @server_options
    def snapshot_create(name: str, subscription: str, ttl: float, snapshot_topic: str, servers: Any) -> None:
        """Take snapshot NAME of --subscription."""
        try:
            taken = make_admin(servers, snapshot_topic).create_snapshot(name, subscription, ttl=ttl)
        except OrderingLayerError as exc:
            raise click.ClickException(str(exc)) from exc
        click.echo(f"snapshot {taken.name} of {taken.subscription}: {len(taken.partitions)} partitions, "
                   f"{taken.settled_above} acked above the committed offsets, expires "
                   f"{taken.expire_at.isoformat(timespec='seconds')}")

    @snapshot.command("list")
    @_snapshot_topic
    @server_options
    def snapshot_list(snapshot_topic: str, servers: Any) -> None:
        """The snapshots that have not expired (a table)."""
        try:
            snapshots = make_admin(servers, snapshot_topic).list_snapshots()
        except OrderingLayerError as exc:
            raise click.ClickException(str(exc)) from exc
        click.echo(render_table(["NAME", "SUBSCRIPTION", "TOPIC", "CREATED", "EXPIRES", "PARTITIONS", "ACKED ABOVE"],
                                snapshot_rows(snapshots)))
        click.echo(f"{len(snapshots)} snapshots", err=True)

    @snapshot.command("delete")
    @click.argument("name")
    @_snapshot_topic
    @server_options
    def snapshot_delete(name: str, snapshot_topic: str, servers: Any) -> None:
        """Delete snapshot NAME."""
        try:
            make_admin(servers, snapshot_topic).delete_snapshot(name)
        except OrderingLayerError as exc:
            raise click.ClickException(str(exc)) from exc
        click.echo(f"deleted snapshot {name}")

    return snapshot
