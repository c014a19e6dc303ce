"""``ordering_layer.aio.calls``: serial calls, what a cancelled call received given back, callbacks on the loop."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from ordering_layer.aio.calls import CallGate, Lazy, on_loop


class _Fake:
    """Stands for a delivered ``Message``: records its nack."""

    def __init__(self) -> None:
        self.settled = False
        self.nacked = False

    def nack(self, error: str | None = None) -> None:
        self.settled = self.nacked = True


def _messages(result: list[_Fake]) -> Iterable[Any]:
    return result


async def _until(condition: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_cancelled_call_gives_back_what_it_returns_before_the_next_serial_call_runs() -> None:
    """SUB-3: the consumer's next poll would auto-ack what the cancelled one received; the gate
    nacks it first, and the next serial call starts only then."""
    started, release = threading.Event(), threading.Event()
    fakes = [_Fake(), _Fake()]
    order: list[str] = []

    def first() -> list[_Fake]:
        started.set()
        release.wait(10)
        order.append("first returned")
        return fakes

    def second() -> str:
        order.append(f"second ran, given back: {all(f.nacked for f in fakes)}")
        return "second"

    async def main() -> str:
        gate = CallGate.made(None, 4, "test-gate")
        waiting = asyncio.ensure_future(gate.call(first, serial=True, given=_messages))
        await _until(started.is_set)
        nxt = asyncio.ensure_future(gate.call(second, serial=True))
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        assert gate._serial.locked(), "the cancelled call holds the lock until its thread is done"
        assert order == [] and not nxt.done()
        release.set()
        result = await asyncio.wait_for(nxt, 10)
        await gate.shutdown()
        return result

    assert asyncio.run(main()) == "second"
    assert order == ["first returned", "second ran, given back: True"]
    assert all(f.nacked for f in fakes)


def test_a_call_that_returns_keeps_its_messages() -> None:
    async def main() -> list[_Fake]:
        gate = CallGate.made(None, 2, "test-gate")
        result = await gate.call(lambda: [_Fake()], serial=True, given=_messages)
        await gate.shutdown()
        return result

    assert [f.nacked for f in asyncio.run(main())] == [False]


def test_a_callback_calling_back_is_admitted_while_a_serial_call_waits_for_it() -> None:
    """A rebalance callback runs on the client's thread while a serial call (close) is in flight
    and waits for it; the callback's own calls are admitted at once instead of deadlocking."""
    told: list[str] = []

    async def main() -> None:
        gate = CallGate.made(None, 4, "test-gate")

        async def on_revoke(consumer: str, partitions: list[int]) -> None:
            told.append(await gate.call(lambda: f"commit by {consumer} of {partitions}", serial=True))

        callback = on_loop(gate, on_revoke, "on_revoke", first="the aio consumer")
        await asyncio.wait_for(gate.call(lambda: callback("the sync consumer", [0, 1]), serial=True), 10)
        await gate.shutdown()

    asyncio.run(main())
    assert told == ["commit by the aio consumer of [0, 1]"]


def test_a_failing_callback_is_logged_not_raised_into_the_client(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        gate = CallGate.made(None, 2, "test-gate")

        async def stats_cb(stats: str) -> None:
            raise ValueError(stats)

        await gate.call(lambda: on_loop(gate, stats_cb, "stats_cb")("{}"))
        await gate.shutdown()

    asyncio.run(main())
    assert "stats_cb raised" in caplog.text


def test_a_client_that_could_not_be_made_is_tried_again() -> None:
    attempts: list[int] = []

    def make() -> str:
        attempts.append(1)
        if len(attempts) == 1:
            raise ConnectionError("broker down")
        return "client"

    async def main() -> str:
        gate = CallGate(asyncio.get_running_loop(), ThreadPoolExecutor(2), owns_executor=True)
        lazy = Lazy(gate, make)
        with pytest.raises(ConnectionError):
            await lazy.get()
        made = await lazy.get()
        await gate.shutdown()
        return made

    assert asyncio.run(main()) == "client"
    assert len(attempts) == 2


def test_a_gate_needs_a_running_loop() -> None:
    with pytest.raises(RuntimeError):
        CallGate.made(None, 1, "test-gate")
