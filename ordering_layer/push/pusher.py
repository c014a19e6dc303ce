"""``Pusher``: delivers a push subscription's messages to its HTTP endpoint (PSH-1..3).

It is a subscriber like any other (``Subscriber.subscribe``): several pushers of one subscription
share its partitions, and per-key order, leases, cascade redelivery, retries and dead letters are
the engine's (SUB-1..5, ACK-*, DLQ-*). Its callback is a coroutine awaited on the pusher's event loop
(a thread of its own), by ``max_concurrent_requests`` worker coroutines (``AsyncWorkers``): the
engine hands each released message straight to the loop, with no thread between, where it waits
for the next free worker. The worker sends the message's request (aiohttp) and acks or nacks it
from the answer (the acks of one pass of the loop go to the engine together,
``PassAcks``); the message stays outstanding, its lease extended, until then. With ordering on, the
engine hands over a key's next message only after this one is acked, so one request per key is
outstanding (PSH-2).

The answer: 102, 200, 201, 202 and 204 ack; any other status, a timeout or a failed connection
nacks, so the key waits by the retry policy and the message is dead-lettered after
``max_delivery_attempts`` like any (DLQ-1..2). While the endpoint cannot be reached the other keys'
messages wait at the ``EndpointGate`` instead of failing one by one (``gate``).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
from collections import Counter, deque
from collections.abc import Mapping
from typing import Any

import aiohttp

from ordering_layer import metrics
from ordering_layer.config import FlowControl, PushConfig
from ordering_layer.errors import ConfigError
from ordering_layer.kafka_config import read_kafka_config
from ordering_layer.push.acks import PassAcks
from ordering_layer.push.auth import Authorizer
from ordering_layer.push.gate import EndpointGate
from ordering_layer.push.request import ACK_STATUSES, build
from ordering_layer.push.stages import ANSWERED, SENDING, SETTLED, WORKER, StageClock
from ordering_layer.state import StateStore
from ordering_layer.subscriber import AsyncWorkers, Message, StreamingPullFuture, Subscriber
from ordering_layer.subscriber.client_config import redis_url_from

_LOGGER = logging.getLogger(__name__)

USER_AGENT = "ordering-layer-push/1"
STOPPING = "pusher stopping"  # the nack error of messages a closing pusher had not sent


def status_class(status: int | None, timed_out: bool = False) -> str:
    """The metrics label of a request's outcome: ``1xx`` .. ``5xx``, ``timeout`` or ``error`` (no answer)."""
    if status is not None:
        return f"{status // 100}xx"
    return "timeout" if timed_out else "error"


def ssl_context(config: PushConfig) -> ssl.SSLContext:
    """A verifying TLS context: the system's CAs, or only those of ``config.ca_bundle`` (PSH-3)."""
    return ssl.create_default_context(cadata=config.ca_bundle) if config.ca_bundle else ssl.create_default_context()


class Pusher:
    """Runs the push subscription ``subscription`` at this process until ``close()``.

    Args:
        kafka_config: confluent-kafka settings (``bootstrap.servers`` required; the consumer's own
            settings such as ``session.timeout.ms`` pass through, as for ``Subscriber``).
        subscription: a subscription created with a ``push_config``.
        redis_url: the layer's Redis (default ``$ORDERING_LAYER_REDIS_URL``).
        flow_control: limits on the messages outstanding here (SUB-7); the default lets out twice
            ``max_concurrent_requests`` messages, one in each worker's hands and one waiting for
            it: a worker finds its next message at once, and a message waits in the pusher about
            one request's time (one held longer than ``flushes.LEASE_WRITE_AGE`` costs a lease
            write to Redis).
        metrics_port: serve Prometheus metrics (the subscriber's and the pusher's) on this port.
        stages: mark each message at each step of the pusher on this clock (``stages``).

    Raises:
        ConfigError: the subscription has no ``push_config``, its JWT key cannot sign, a setting is
            missing.
        SubscriptionNotFoundError: no such subscription.
    """

    def __init__(self, kafka_config: Mapping[str, Any], subscription: str, *, redis_url: str | None = None,
                 flow_control: FlowControl | None = None, metrics_port: int | None = None,
                 stages: StageClock | None = None) -> None:
        kafka = read_kafka_config(kafka_config)
        url = redis_url_from(redis_url)
        settings = StateStore(url, kafka_config=kafka).settings(subscription)
        if settings.push_config is None:
            raise ConfigError(f"subscription {subscription!r} has no push_config: it is not a push subscription")
        self.subscription = subscription
        self.topic = settings.topic
        self.config: PushConfig = settings.push_config
        self.push_endpoint = self.config.display_endpoint
        self._authorizer = Authorizer(self.config, subscription)
        self._ssl = ssl_context(self.config)
        self._flow_control = flow_control or FlowControl(
            max_messages=2 * self.config.max_concurrent_requests)
        self._subscriber = Subscriber(kafka, redis_url=url, metrics_port=metrics_port)
        self._metrics = metrics_port is not None
        self._stages = stages
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"ordering-layer-push-{subscription}",
                                        daemon=True)
        self._streaming: StreamingPullFuture | None = None
        self._closing = False
        self._closed = False
        self._workers = AsyncWorkers(self._loop, self.config.max_concurrent_requests)
        # Loop state, made on the loop by _open.
        self._session: aiohttp.ClientSession | None = None
        self._gate: EndpointGate | None = None
        self._acks = PassAcks()
        # Metrics: written on the loop, read by scrapes (pull model, ``metrics_snapshot``).
        self.requests: Counter[str] = Counter()
        self._latencies: deque[float] = deque()  # kept for the scrapes only: with metrics on
        self._at_gate = 0  # messages taken by a worker and waiting at the gate
        self.in_flight = 0

    # -- start and stop -------------------------------------------------------------------------------
    def start(self) -> Pusher:
        """Join the subscription and start pushing.

        Raises:
            RuntimeError: started twice.
        """
        with self._lock:
            if self._streaming is not None or self._closed:
                raise RuntimeError("pusher already started")
            self._thread.start()
            asyncio.run_coroutine_threadsafe(self._open(), self._loop).result()
            self._streaming = self._subscriber.subscribe(self.subscription, self._push,
                                                         flow_control=self._flow_control, executor=self._workers)
        if self._metrics:
            metrics.register(self)
        _LOGGER.info("pushing %s to %s (%d requests at most, auth %s)", self.subscription, self.push_endpoint,
                     self.config.max_concurrent_requests, self.config.auth)
        return self

    async def _open(self) -> None:
        config = self.config
        self._gate = EndpointGate()
        connector = aiohttp.TCPConnector(limit=config.max_concurrent_requests, limit_per_host=0, ssl=self._ssl)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=config.request_timeout),
            headers={"User-Agent": USER_AGENT}, auto_decompress=False)

    def close(self, timeout: float = 30.0) -> None:
        """Stop: no new request starts, those in flight finish (their answers ack or nack), the
        messages not sent yet are nacked, then the subscription is left as ``StreamingPullFuture.cancel``
        leaves it (commit, group leave). Harmless when called again."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._closing = True
            streaming = self._streaming
        if streaming is not None:
            # The engine stops releasing at once and then waits for the outstanding messages, which
            # the loop settles meanwhile.
            leaving = threading.Thread(target=streaming.cancel, args=(timeout,), name="ordering-layer-push-leave",
                                       daemon=True)
            leaving.start()
            asyncio.run_coroutine_threadsafe(self._drain_out(), self._loop).result(timeout)
            leaving.join(timeout)
            if leaving.is_alive():
                _LOGGER.warning("%s: requests still in flight after %.0f s; leaving them to lease expiry",
                                self.subscription, timeout)
        if self._metrics:
            metrics.unregister(self)
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._shut(), self._loop).result(timeout)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
        _LOGGER.info("pusher of %s stopped", self.subscription)

    async def _drain_out(self) -> None:
        """Let what waits at a closed gate through to be nacked (the workers nack what is queued)."""
        assert self._gate is not None
        await self._gate.close()

    async def _shut(self) -> None:
        if self._session is not None:
            await self._session.close()

    def __enter__(self) -> Pusher:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- requests ------------------------------------------------------------------------------------
    async def _push(self, message: Message) -> None:
        """The subscription's callback, run by a worker on the loop: push the message (it stays
        outstanding until the answer acks or nacks it)."""
        stages = self._stages
        if stages is not None:
            stages.mark(message.message_id, WORKER)
        if self._closing:
            message.nack(error=STOPPING)
            return
        gate, session, config = self._gate, self._session, self.config
        assert gate is not None and session is not None
        probe = False
        if gate.failures:
            self._at_gate += 1
            try:
                probe = await gate.enter()
            finally:
                self._at_gate -= 1
            if self._closing:  # let through by the closing gate
                message.nack(error=STOPPING)
                return
        body, headers = build(message, self.subscription, config.no_wrapper)
        authorization = self._authorizer.header()
        if authorization is not None:
            headers["Authorization"] = authorization
        loop = self._loop
        status: int | None = None
        failure = ""
        timed_out = False
        self.in_flight += 1
        started = loop.time()
        if stages is not None:
            stages.mark(message.message_id, SENDING)
        try:
            async with session.post(config.endpoint, data=body, headers=headers, allow_redirects=False) as response:
                status = response.status
                await response.read()  # the connection goes back to the pool only once the body is read
        except TimeoutError:
            timed_out = True
            failure = f"no answer within {config.request_timeout:g} s"
        except aiohttp.ClientError as exc:
            failure = self._describe(exc)
        finally:
            self.in_flight -= 1
        if stages is not None:
            stages.mark(message.message_id, ANSWERED)
        if self._metrics:
            self._latencies.append(loop.time() - started)
        self.requests[status_class(status, timed_out)] += 1
        if status is not None:
            if probe or gate.failures:
                await gate.answered(probe)
            if status in ACK_STATUSES:
                self._acks.ack(message)
            else:
                message.nack(error=f"HTTP {status}")
            if stages is not None:
                stages.mark(message.message_id, SETTLED)
            return
        if await gate.unreachable(probe):
            _LOGGER.warning("%s: endpoint %s unreachable (%s); next try in %.1f s", self.subscription,
                            self.push_endpoint, failure, gate.wait_left())
        message.nack(error=failure)
        if stages is not None:
            stages.mark(message.message_id, SETTLED)

    def _describe(self, exc: aiohttp.ClientError) -> str:
        """The failure of a request as text, the endpoint's query (which may hold a token) elided."""
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return text.replace(self.config.endpoint, self.push_endpoint)

    # -- metrics -------------------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        """Messages handed over and not yet sent: queued for a worker, or at the gate."""
        return self._workers.waiting + self._at_gate

    def metrics_snapshot(self) -> dict[str, Any]:
        """``requests``: {status class: count} (monotonic); ``keys_waiting``: messages handed over and
        not yet sent (one per ordering key with ordering on); ``in_flight``: requests outstanding;
        ``request_latency_seconds``: the request durations since the previous call (drained)."""
        latencies, taken = self._latencies, []
        for _ in range(len(latencies)):
            taken.append(latencies.popleft())
        return {"requests": dict(self.requests), "keys_waiting": self.waiting, "in_flight": self.in_flight,
                "request_latency_seconds": taken}
