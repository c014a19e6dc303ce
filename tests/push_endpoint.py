"""A real HTTP endpoint for the push tests and the push benchmark (aiohttp's server).

``PushEndpoint`` runs in a thread of the test process, on an event loop of its own: every request is
kept (``received``), with its arrival time, headers and body, and answered as ``answer`` decides
(status, and seconds to wait before answering). ``stop()`` closes the listening socket (connections
are refused) and ``start()`` opens it again on the same port: an endpoint that is down for a while.
With ``tls`` (a server context) it serves https.

Run as a process (``python -m tests.push_endpoint --port N``), it answers every POST at once with
204 and serves ``GET /stats``: request count, first and last arrival time and, with ``?full=1``, for
bodies that carry a publish time in ``message.attributes.sent`` (seconds since the epoch, as the
benchmark publishes), the arrival delays and the publish and arrival times by message id; the
benchmark reads them there.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from aiohttp import web


@dataclass(frozen=True)
class Received:
    """One request as the endpoint saw it."""

    at: float  # time.time() at arrival
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> dict[str, Any]:
        """The body as JSON (the wrapped push request)."""
        parsed: dict[str, Any] = json.loads(self.body)
        return parsed

    @property
    def message(self) -> dict[str, Any]:
        """The ``message`` of a wrapped push request."""
        message: dict[str, Any] = self.json["message"]
        return message

    @property
    def message_id(self) -> str:
        """The pushed message's id."""
        return str(self.message["messageId"])

    @property
    def data(self) -> bytes:
        """The pushed message's payload (decoded from base64)."""
        return base64.b64decode(self.message["data"])

    @property
    def attempt(self) -> int:
        """The request's ``deliveryAttempt``."""
        return int(self.json["deliveryAttempt"])


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


# (status, seconds to wait before answering)
Answer = tuple[int, float]


@dataclass
class PushEndpoint:
    """An HTTP endpoint in a thread (see the module doc)."""

    answer: Callable[[Received], Answer] = lambda _: (200, 0.0)
    tls: ssl.SSLContext | None = None
    received: list[Received] = field(default_factory=list)
    port: int = 0
    in_flight: int = 0  # requests being answered
    most_in_flight: int = 0
    _loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    _app: web.Application = field(init=False)
    _runner: web.AppRunner | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _changed: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self._changed = threading.Condition(self._lock)
        if not self.port:
            self.port = free_port()
        threading.Thread(target=self._loop.run_forever, name="push-endpoint", daemon=True).start()
        self._call(self._setup())
        self.start()

    @property
    def url(self) -> str:
        """The endpoint's URL."""
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}/push"

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(10)

    async def _setup(self) -> None:
        self._app = web.Application()
        self._app.router.add_post("/push", self._handle)

    async def _handle(self, request: web.Request) -> web.Response:
        seen = Received(time.time(), dict(request.headers), await request.read())
        with self._changed:
            self.received.append(seen)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self._changed.notify_all()
        try:
            status, delay = self.answer(seen)
            if delay:
                await asyncio.sleep(delay)
        finally:
            with self._lock:
                self.in_flight -= 1
        return web.Response(status=status)

    def start(self) -> None:
        """Listen (again, on the same port)."""

        async def listen() -> None:
            self._runner = web.AppRunner(self._app, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=self.tls, reuse_address=True)
            await site.start()

        self._call(listen())

    def stop(self) -> None:
        """Close the listening socket and the open connections: requests are refused until ``start``."""

        async def close() -> None:
            if self._runner is not None:
                await self._runner.cleanup()
                self._runner = None

        self._call(close())

    def close(self) -> None:
        """Stop serving for good."""
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)

    def count(self) -> int:
        """Requests received so far."""
        with self._lock:
            return len(self.received)

    def wait_for(self, condition: Callable[[list[Received]], bool], timeout: float, what: str) -> None:
        """Wait (on the endpoint's condition, not by polling) until ``condition(received)`` holds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not condition(self.received):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} "
                                         f"({len(self.received)} requests received)")
                self._changed.wait(left)


# -- as a process, for the benchmark ------------------------------------------------------------------
def serve(port: int) -> None:
    """Answer every POST at once with 204; ``GET /stats`` gives the count, the first and last arrival
    times and, with ``?full=1``, the arrival delays, the delays from the broker's append time
    (``publishTime``: the layer's topics are made with broker append time) and ``arrivals``
    (``{messageId: [publish time, arrival time]}``) (``?reset=1`` starts them over)."""
    bodies: list[tuple[bytes, float]] = []  # (body, arrival time): read at /stats, not while serving
    seen = {"count": 0, "first": 0.0, "last": 0.0}

    async def push(request: web.Request) -> web.Response:
        body = await request.read()
        now = time.time()
        seen["count"] += 1
        seen["first"] = seen["first"] or now
        seen["last"] = now
        if body[:1] == b"{":
            bodies.append((body, now))
        return web.Response(status=204)

    def timings() -> dict[str, Any]:
        delays: list[float] = []
        appended: list[float] = []
        arrivals: dict[str, tuple[float, float]] = {}
        for body, now in bodies:
            message = json.loads(body)["message"]
            sent = message.get("attributes", {}).get("sent")
            if sent is not None:
                delays.append(now - float(sent))
                arrivals[message["messageId"]] = (float(sent), now)
                stamp = datetime.fromisoformat(message["publishTime"].replace("Z", "+00:00"))
                appended.append(now - stamp.timestamp())
        return {"delays": delays, "appended": appended, "arrivals": arrivals}

    async def stats(request: web.Request) -> web.Response:
        full = timings() if request.query.get("full") else {}
        reply = web.json_response({**seen, **full})
        if request.query.get("reset"):
            bodies.clear()
            seen.update(count=0, first=0.0, last=0.0)
        return reply

    app = web.Application()
    app.router.add_post("/push", push)
    app.router.add_get("/stats", stats)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    serve(parser.parse_args().port)
