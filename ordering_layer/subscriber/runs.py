"""A key's run in the callback hand-outs (``handoff.CallbackPool``, ``executors``, ``processes``;
SUB-1, SUB-9).

When few keys are ready the engine releases a *run*: consecutive messages of one key in one
hand-out, up to ``RUN_MAX``. A run's messages start one at a time, each once the one before it is
acked, while the run is young (``RUN_SPAN``: the rest keep their leases short of lapsing) and its
partition still owned; the rest go back unstarted through ``Hooks.give_back`` (their attempts
taken back; after a nack its rewind took them back already).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ordering_layer._core import items_of
from ordering_layer.subscriber.message import Message

RUN_MAX = 128  # records of one key released to one hand-out at a time, at most (callback mode)
RUN_SPAN = 0.1  # seconds a run goes on; the rest goes back after it

Item = Message | list[Message]  # one message, or a key's run of consecutive messages

__all__ = ["RUN_MAX", "RUN_SPAN", "Hooks", "Item", "goes_on", "items_of", "run_item"]


@dataclass(frozen=True)
class Hooks:
    """The engine's side of a hand-out: ``begin`` (False: user code must not run, see
    ``Engine.begin``; True at once when there is nothing to do), ``give_back`` (messages of a run
    left unstarted) and ``current`` (the message's partition is still owned, ``Engine.owns``)."""

    begin: Callable[[Message], bool]
    give_back: Callable[[list[Message]], None]
    current: Callable[[Message], bool]


def goes_on(previous: Message, began: float, message: Message, hooks: Hooks) -> bool:
    """Whether a key's run goes on with ``message``: the one before it was acked, the run is young
    and the partition still owned."""
    return previous.settled is True and time.monotonic() - began <= RUN_SPAN and hooks.current(message)


def run_item(item: Item, run: Callable[[Message], None], hooks: Hooks) -> None:
    """Run one item on this thread: a message, or a run's messages in order while ``goes_on``."""
    if isinstance(item, Message):
        run(item)
        return
    began = time.monotonic()
    run(item[0])
    for index in range(1, len(item)):
        if not goes_on(item[index - 1], began, item[index], hooks):
            hooks.give_back(item[index:])
            return
        run(item[index])
