"""The prober's progress line: in place on a terminal, plain lines otherwise."""

from __future__ import annotations

import io

from ordering_layer.prober.progress import ProgressLine


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


COUNTERS = {"published": 1200, "deliveries": 1100, "acked_messages": 1000, "backlog": 200, "redeliveries": 55,
            "violations": 0}


def test_plain_lines_when_not_a_terminal() -> None:
    """Not a terminal: one full line per update, no control characters."""
    out = io.StringIO()
    line = ProgressLine(out, interval=5.0)
    line.update(COUNTERS, force=True)
    line.update(COUNTERS)  # within the interval: nothing
    line.close()
    text = out.getvalue()
    assert text.count("\n") == 1 and "\r" not in text and "\x1b" not in text
    assert "published 1,200" in text and "backlog 200" in text and "violations 0" in text


def test_rewritten_in_place_on_a_terminal() -> None:
    """A terminal: each update returns to the line start and erases it; close ends the line."""
    out = Terminal()
    line = ProgressLine(out)
    line.update(COUNTERS, force=True)
    line.update({**COUNTERS, "violations": 2}, force=True)
    line.close()
    text = out.getvalue()
    assert text.count("\r\x1b[K") == 2 and text.endswith("violations 2\n")
