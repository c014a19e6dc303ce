"""``subscription describe`` as text: a header and one table row per partition.

Plain column formatting rather than a table library: one fixed-shape table does not justify a new
dependency, and plain text stays greppable and stable for scripts that read it.
"""

from __future__ import annotations

from ordering_layer.config import PushConfig
from ordering_layer.describe import PartitionDescription, SubscriptionDescription

COLUMNS = ("partition", "owner", "epoch", "committed", "log end", "backlog", "outstanding", "oldest unacked",
           "held keys", "parked keys", "moved keys held", "seek")


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def _cells(row: PartitionDescription) -> tuple[str, ...]:
    owner = f"{row.owner}@{row.owner_host.lstrip('/')}" if row.owner and row.owner_host else (row.owner or "-")
    return (str(row.partition), owner, "-" if row.epoch is None else str(row.epoch),
            "-" if row.committed is None else str(row.committed), str(row.log_end), str(row.backlog),
            str(row.outstanding), _age(row.oldest_unacked_age),
            str(row.held_keys) if row.held_keys_complete else f">={row.held_keys}", str(row.parked_keys),
            str(row.moved_keys_held), f"pending #{row.pending_seek}" if row.pending_seek else "-")


def _push_line(push: PushConfig) -> str:
    """The push endpoint and how it is called (the secrets only named, never shown)."""
    auth = {"bearer": "static bearer token", "jwt": f"JWT {push.jwt_algorithm} from {push.jwt_issuer}",
            "none": "no auth"}[push.auth]
    return (f"push {push.display_endpoint}  {'raw payload' if push.no_wrapper else 'JSON wrapper'}  "
            f"timeout {push.request_timeout:g}s  concurrency {push.max_concurrent_requests}  {auth}"
            + ("  custom CA bundle" if push.ca_bundle else ""))


def render_description(described: SubscriptionDescription) -> str:
    """The description as a header and an aligned table (numbers right-aligned)."""
    settings = described.settings
    dead_letter = settings.dead_letter_policy
    lines = [
        f"subscription {described.name}  topic {described.topic}  group {described.group_state}",
        f"ordering {'on' if settings.enable_message_ordering else 'off'}  ack_deadline {settings.ack_deadline:g}s  "
        + (f"dead letters {dead_letter.topic} after {dead_letter.max_delivery_attempts} attempts ({dead_letter.mode})"
           if dead_letter else "no dead-letter topic"),
        *([_push_line(settings.push_config)] if settings.push_config is not None else []),
        f"backlog {described.backlog}  outstanding {described.outstanding}  "
        f"parked keys {len(described.parked_keys)}"
        + (f" ({', '.join(described.parked_keys[:10])}{', ...' if len(described.parked_keys) > 10 else ''})"
           if described.parked_keys else ""),
        "",
    ]
    rows = [COLUMNS, *(_cells(row) for row in described.partitions)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    left = {1}  # the owner column is text
    for row in rows:
        lines.append("  ".join(cell.ljust(w) if i in left else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths, strict=True))).rstrip())
    return "\n".join(lines)
