"""A subscriber process for crash tests: logs every delivery and ack as JSON lines, flushed at once.

Run as ``python -m tests.integration.subscriber_worker --help``. The test kills it with SIGKILL;
SIGTERM stops it gracefully (outstanding deliveries finish, offsets are committed).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import IO

from ordering_layer import AckResponse, Message, Subscriber
from ordering_layer.stack import Endpoints

CRASH_WAIT = 3.0  # seconds a crash waits at most for --crash-with other messages to start


def main() -> None:
    """Subscribe until killed (or until ``--seconds`` pass)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--kafka-config", default="", help="properties file of further Kafka client settings")
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--subscription", required=True)
    parser.add_argument("--name", required=True, help="subscriber name written into the log")
    parser.add_argument("--log", required=True, help="JSON-lines file to append events to")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="handler time per message")
    parser.add_argument("--crash-on", default=None, help="message data that makes the process os._exit(3)")
    parser.add_argument("--crash-with", type=int, default=0,
                        help=f"the crash waits (up to {CRASH_WAIT:.0f} s) until this many other messages started here")
    parser.add_argument("--workers", type=int, default=8, help="callback workers")
    parser.add_argument("--hold-unless-key", default=None,
                        help="messages of every other ordering key are held by their handler until the process ends")
    parser.add_argument("--hold-data", default=None,
                        help="the message with this data is held by its handler until the process ends")
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--session-ms", type=int, default=6000, help="Kafka session timeout")
    args = parser.parse_args()
    logging.basicConfig(filename=f"{args.log}.{args.name}.log", level=logging.INFO,
                        format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s")
    lock = threading.Lock()
    started = threading.Condition()
    others = [0]  # messages other than the crashing one whose handler started in this process
    out: IO[str] = open(args.log, "a", buffering=1)  # noqa: SIM115 - lives as long as the process

    def log(message: Message, action: str) -> None:
        line = json.dumps({"id": message.message_id, "key": message.ordering_key, "sub": args.name,
                           "attempt": message.delivery_attempt, "action": action, "at": time.time()})
        with lock:
            out.write(line + "\n")
            out.flush()

    def callback(message: Message) -> None:
        log(message, "deliver")
        if args.crash_on is not None and message.data.decode() == args.crash_on:
            with started:
                started.wait_for(lambda: others[0] >= args.crash_with, CRASH_WAIT)
            os._exit(3)
        with started:
            others[0] += 1
            started.notify_all()
        if (args.hold_unless_key is not None and message.ordering_key != args.hold_unless_key) \
                or (args.hold_data is not None and message.data.decode() == args.hold_data):
            threading.Event().wait()
        if args.delay_ms:
            time.sleep(args.delay_ms / 1000)
        log(message, "release")
        if message.ack_with_response().result(30) == AckResponse.SUCCESS:
            log(message, "ack")

    kafka = {**Endpoints(args.bootstrap, args.redis_url, args.kafka_config).kafka_config(),
             "session.timeout.ms": args.session_ms, "heartbeat.interval.ms": max(250, args.session_ms // 6)}
    subscriber = Subscriber(kafka, redis_url=args.redis_url)
    handle = subscriber.subscribe(args.subscription, callback, max_workers=args.workers)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda _signum, _frame: stop.set())  # SIGTERM: a graceful stop
    print("subscribed", flush=True)
    deadline = time.monotonic() + args.seconds
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            handle.result(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
            break
        except TimeoutError:
            continue
    handle.cancel()
    sys.exit(0)


if __name__ == "__main__":
    main()
