"""The prober command's argument handling and exit statuses, without servers."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from ordering_layer.cli import main
from ordering_layer.prober.cli import _delay_range

UNREACHABLE = ["--bootstrap", "127.0.0.1:1", "--redis-url", "redis://127.0.0.1:1/0", "--no-progress"]


def test_delay_range_in_milliseconds() -> None:
    """--delay-ms takes MS or LOW-HIGH and yields seconds."""
    assert _delay_range("5") == (0.005, 0.005)
    assert _delay_range("1-20") == (0.001, 0.02)
    for bad in ("x", "5-1", "-3"):
        with pytest.raises(click.BadParameter):
            _delay_range(bad)


def test_unreachable_servers_exit_with_status_2() -> None:
    """A run that cannot be made exits 2 with the reason (1 is kept for violations)."""
    result = CliRunner().invoke(main, ["prober", "--mode", "check", "--subscription", "nope", *UNREACHABLE])
    assert result.exit_code == 2
    assert "ConnectionError" in result.stderr


@pytest.mark.parametrize("args", [["-X", "no-equals-sign"], ["--delay-ms", "9-1"], ["--mode", "consume"]])
def test_bad_arguments_exit_with_status_2(args: list[str]) -> None:
    """Malformed -X, a reversed delay range, consume mode without --events: refused before any I/O."""
    result = CliRunner().invoke(main, ["prober", *args, *UNREACHABLE])
    assert result.exit_code == 2, result.output
