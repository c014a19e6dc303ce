"""The prober's progress line: rewritten in place on a terminal, one plain line per interval otherwise.

Written by hand rather than with ``rich`` or ``tqdm``: one status line needs a carriage return and
an erase-line escape, not a dependency.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class ProgressLine:
    """Shows run counters (published, delivered, acked, backlog, redeliveries, violations) and rates.

    Args:
        out: where to write (default stderr, so that stdout keeps the JSON summary).
        interval: seconds between plain lines when ``out`` is not a terminal.
    """

    def __init__(self, out: TextIO | None = None, *, interval: float = 5.0) -> None:
        self._out = out or sys.stderr
        self._tty = self._out.isatty()
        self._interval = 0.5 if self._tty else interval
        self._started = time.monotonic()
        self._last_shown = 0.0
        self._last: tuple[float, int, int] | None = None
        self._shown = False

    def update(self, counters: dict[str, Any], *, force: bool = False) -> None:
        """Show ``counters`` if the interval has passed (or ``force``)."""
        now = time.monotonic()
        if not force and now - self._last_shown < self._interval:
            return
        published, delivered = int(counters.get("published", 0)), int(counters.get("deliveries", 0))
        if self._last is not None and now > self._last[0]:
            span = now - self._last[0]
            pub_rate, del_rate = (published - self._last[1]) / span, (delivered - self._last[2]) / span
        else:
            pub_rate = del_rate = 0.0
        self._last = (now, published, delivered)
        self._last_shown = now
        line = (f"{now - self._started:6.0f}s  published {published:,} ({pub_rate:,.0f}/s)  "
                f"delivered {delivered:,} ({del_rate:,.0f}/s)  acked {int(counters.get('acked_messages', 0)):,}  "
                f"backlog {int(counters.get('backlog', 0)):,}  "
                f"redelivered {int(counters.get('redeliveries', 0)):,}  "
                f"violations {int(counters.get('violations', 0)):,}")
        if self._tty:
            self._out.write("\r\x1b[K" + line)
            self._shown = True
        else:
            self._out.write(line + "\n")
        self._out.flush()

    def close(self) -> None:
        """End the in-place line (on a terminal)."""
        if self._shown:
            self._out.write("\n")
            self._out.flush()
