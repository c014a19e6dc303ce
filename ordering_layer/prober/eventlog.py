"""The prober's event stream between processes: JSON-lines files in one folder.

Each subscriber process appends its events to its own file ``<folder>/<subscriber id>.jsonl``
(``EventLog``), one line per event, written and flushed before the handler acks or nacks, so a
process killed with SIGKILL has recorded every delivery it acted on. A harness reports faults in
another file of the folder (for example ``faults.jsonl``), a publisher its per-key counts
(``Expectation`` lines). The checker (``EventFolderReader``) tails every ``*.jsonl`` file there,
new ones included, and merges them by event time: within one key, events of different processes
are seconds apart (a key moves only after its holder is lost or released it), so a merge that
holds events back ``lag`` seconds puts them in causal order.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from ordering_layer.errors import ConfigError
from ordering_layer.prober.events import Event, from_json, to_json

_LOGGER = logging.getLogger(__name__)


class EventLog:
    """Appends events to a JSON-lines file, one flushed line each (thread-safe)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._file: IO[str] = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - closed by close()

    def __call__(self, event: Event) -> None:
        """Append ``event`` (one write of one line, flushed at its newline)."""
        line = to_json(event) + "\n"
        with self._lock:
            self._file.write(line)

    def close(self) -> None:
        """Close the file."""
        with self._lock:
            self._file.close()


class _Tail:
    __slots__ = ("file", "index", "partial")

    def __init__(self, file: IO[bytes], index: int) -> None:
        self.file = file
        self.index = index
        self.partial = b""


class EventFolderReader:
    """Reads the events of every ``*.jsonl`` file in ``folder`` as they are appended, in time order.

    Args:
        folder: where the writers' files are (it may not exist yet).
        lag: seconds an event is held back so that an earlier event of a slower writer can still
            come before it. An event older than one already released is counted in ``late``.
    """

    def __init__(self, folder: Path, *, lag: float = 2.0) -> None:
        self.folder = folder
        self.lag = lag
        self.late = 0
        self.malformed = 0
        self.last_read = time.monotonic()
        self._tails: dict[Path, _Tail] = {}
        self._heap: list[tuple[float, int, int, Event]] = []
        self._order = 0
        self._released_at = float("-inf")

    def poll(self, now: float | None = None) -> list[Event]:
        """New events older than ``lag`` seconds (wall clock ``now``), oldest first."""
        self._read()
        horizon = (time.time() if now is None else now) - self.lag
        return self._pop(lambda at: at <= horizon)

    def drain(self) -> list[Event]:
        """Every event read so far and not yet returned, oldest first (at the end of a check)."""
        self._read()
        return self._pop(lambda _at: True)

    def close(self) -> None:
        """Close the files."""
        for tail in self._tails.values():
            tail.file.close()
        self._tails.clear()

    def _pop(self, ready: Callable[[float], bool]) -> list[Event]:
        out: list[Event] = []
        heap = self._heap
        while heap and ready(heap[0][0]):
            at, _, _, event = heapq.heappop(heap)
            if at < self._released_at:
                self.late += 1
            self._released_at = max(self._released_at, at)
            out.append(event)
        return out

    def _read(self) -> None:
        if self.folder.is_dir():
            for path in sorted(self.folder.glob("*.jsonl")):
                if path not in self._tails:
                    self._tails[path] = _Tail(open(path, "rb"), len(self._tails))  # noqa: SIM115 - closed by close()
        for path, tail in self._tails.items():
            chunk = tail.file.read()
            if not chunk:
                continue
            self.last_read = time.monotonic()
            *lines, tail.partial = (tail.partial + chunk).split(b"\n")
            for line in lines:
                if line.strip():
                    self._push(path, tail, line)

    def _push(self, path: Path, tail: _Tail, line: bytes) -> None:
        try:
            event = from_json(line.decode("utf-8"))
        except (ConfigError, UnicodeDecodeError) as exc:
            self.malformed += 1
            _LOGGER.warning("%s: skipping a malformed line: %s", path, exc)
            return
        self._order += 1
        heapq.heappush(self._heap, (event.at, tail.index, self._order, event))
