"""Flushes of ``apply.lua`` calls sent back to back on one connection, their answers read in order
(ACK-4).

A subscriber's flush is a round trip: the released messages it carries wait for its answer before
they are handed out (ACK-6). ``ApplyPipe`` lets the next flush go out before the answer of the one
in flight has come: both are written to the same connection, so Redis runs their calls in the order
sent, and a partition's ops keep the order they were queued in, as with one flush at a time. The
subscriber's coordinator writes them (``send``; one that needs a new connection is written by its
sending thread, the others wait for that write) and reads the answers (``receive``), each flush in
turn, once they have come (``answered``; ``socket`` to wait for them).

A connection that failed (an error writing or reading, a timeout) is not used again: ``receive``
disconnects it, and the next ``send`` takes a new one from the client's pool (and loads the script
first), so that answers are only ever read from the connection their calls were written to. Answers
that are errors (NOSCRIPT after Redis lost its scripts, a refused write) are all read before the
first is raised, so the connection stays in step; after NOSCRIPT the script is loaded for the next
flush. What a failure means for the flushes sent after the failed one is the caller's to decide
(``Ownership`` fails them too and sends their ops again, in order).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import redis

from ordering_layer._core import evalsha_commands
from ordering_layer.state.store import ApplyResult, StateStore


class Sent:
    """A flush written to a connection: where its answers are to be read, how many, and which of the
    pipe's connections it was (``epoch``)."""

    __slots__ = ("connection", "count", "epoch")

    def __init__(self, connection: Any, count: int, epoch: int = 0) -> None:
        self.connection = connection
        self.count = count
        self.epoch = epoch


class ApplyPipe:
    """One connection of ``store``'s client for back-to-back flushes (a single server only,
    ``StateStore.pipelines``)."""

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self._pool = store.client.connection_pool  # type: ignore[union-attr]
        self._connection: Any = None
        self._epoch = 0  # raised with each new connection
        self._failed = False  # the current connection failed: the next send takes a new one
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        """A connection is open and has not failed: ``send`` only writes (no connect, no script load)."""
        with self._lock:
            return self._connection is not None and not self._failed

    def send(self, batches: Sequence[tuple[str, int, int, str]]) -> Sent:
        """Write one flush's ``apply.lua`` calls (the writing thread); the answers are ``receive``'s."""
        with self._lock:
            fresh = self._connection is None or self._failed
            if fresh:
                old, self._connection = self._connection, self._pool.get_connection()
                if old is not None:
                    old.disconnect()  # whatever was written to it since it failed is never read
                    self._pool.release(old)
                self._epoch += 1
                self._failed = False
            connection, epoch = self._connection, self._epoch
        if fresh:
            # A new server, or one restarted since, may not have the script: load it before the
            # first flush rather than have that flush answered NOSCRIPT.
            try:
                self._store.load_script("apply")
            except BaseException:
                self._fail(connection, epoch)
                raise
        # The calls encoded by the core, as redis-py's pack_commands would encode them
        # (``evalsha_commands``); a malformed op raises here, before anything is written.
        packed = evalsha_commands(self._store.script_sha("apply"), self._store.apply_packed_calls(batches))
        try:
            connection.send_packed_command([packed], check_health=False)
        except BaseException:
            self._fail(connection, epoch)
            raise
        return Sent(connection, len(batches), epoch)

    def answered(self, sent: Sent) -> bool:
        """The answers of a written flush can be read without waiting for Redis (or reading them
        raises at once: its connection failed)."""
        with self._lock:
            if sent.epoch != self._epoch or self._failed:
                return True
        try:
            return bool(sent.connection.can_read(timeout=0))
        except Exception:  # noqa: BLE001 - receive raises it, and fails the connection
            return True

    @staticmethod
    def socket(sent: Sent) -> Any:
        """The socket a written flush's answers come on, to wait for them with ``select`` (None when
        the connection has none open)."""
        return getattr(sent.connection, "_sock", None)

    @staticmethod
    def timeout(sent: Sent) -> float:
        """How long a flush's answers may take (the connection's socket timeout)."""
        return getattr(sent.connection, "socket_timeout", None) or 5.0

    def fail(self, sent: Sent) -> None:
        """A written flush was not answered in time: its connection is not used again."""
        self._fail(sent.connection, sent.epoch)

    def receive(self, sent: Sent) -> list[ApplyResult]:
        """Read the answers of a flush ``send`` wrote, after those of every flush written before it
        (the coordinator). Raises the first error answer, or what the connection raised; a flush
        written to a connection that failed since is not read."""
        connection = sent.connection
        with self._lock:
            if sent.epoch != self._epoch or self._failed:
                raise redis.exceptions.ConnectionError("the connection failed while the flush was in flight")
        answers: list[Any] = []
        try:
            for _ in range(sent.count):
                try:
                    answers.append(connection.read_response())
                except redis.exceptions.ResponseError as exc:
                    answers.append(exc)  # read on: the next answers belong to this flush too
        except BaseException:
            self._fail(connection, sent.epoch)
            raise
        errors = [answer for answer in answers if isinstance(answer, Exception)]
        if errors:
            if any(isinstance(error, redis.exceptions.NoScriptError) for error in errors):
                self._store.load_script("apply")
            raise errors[0]
        return [ApplyResult(int(answer)) for answer in answers]

    def _fail(self, connection: Any, epoch: int) -> None:
        connection.disconnect()
        with self._lock:
            if epoch == self._epoch:
                self._failed = True

    def close(self) -> None:
        """Give the connection back to the pool."""
        with self._lock:
            connection, self._connection = self._connection, None
        if connection is not None:
            connection.disconnect()
            self._pool.release(connection)
