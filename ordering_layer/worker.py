"""The one start/stop shape of every background concern: a lock, a stop event, a named daemon thread.

A ``Worker`` runs ``step()`` repeatedly until stopped; ``step`` returns how long to wait before the
next call, and the wait is on the stop event, so ``stop()`` wakes it at once. A failing step is
logged and the loop goes on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

_LOGGER = logging.getLogger(__name__)


class Worker:
    """Runs ``step`` on a named daemon thread until ``stop``; ``step`` returns the pause in seconds."""

    def __init__(self, name: str, step: Callable[[], float]) -> None:
        self._name = name
        self._step = step
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread. Raises ``RuntimeError`` when it was started before."""
        with self._lock:
            if self._thread is not None:
                raise RuntimeError(f"worker {self._name} was started already")
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Ask the loop to end and wait for the thread (up to ``timeout`` seconds)."""
        self._stop.set()
        with self._lock:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                pause = self._step()
            except Exception:
                _LOGGER.exception("worker %s: step failed", self._name)
                pause = 0.5
            if pause > 0:
                self._stop.wait(pause)


def run_bounded(name: str, target: Callable[[], None], timeout: float) -> bool:
    """Run ``target`` on a named daemon thread and wait up to ``timeout`` seconds; False when it is
    still running then (it goes on in the background)."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive()
