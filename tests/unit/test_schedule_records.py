"""Pure logic of scheduled messages (PUB-5): records, settings, the index's key slot, CLI parsing."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import click
import pytest
from click.testing import CliRunner

from ordering_layer import OrderedProducer
from ordering_layer.cli.schedule import parse_when, schedule
from ordering_layer.cli.servers import render_table
from ordering_layer.config import PublisherSettings, from_mapping
from ordering_layer.errors import ConfigError, RecordFormatError
from ordering_layer.scheduler.index import index_keys
from ordering_layer.scheduler.records import ScheduledMessage, ScheduleState, epoch_ms
from ordering_layer.scheduler.settings import SchedulerSettings


def test_record_round_trip_and_terminal_state() -> None:
    message = ScheduledMessage("id1", "orders", b"\x00data", 1_700_000_000_123, 1_700_000_000_000,
                               ordering_key="clé".encode(), attributes={"a": "1"})
    assert ScheduledMessage.decode(message.encode()) == message
    assert message.enqueue_at == datetime(2023, 11, 14, 22, 13, 20, 123000, tzinfo=UTC)
    done = message.finished(ScheduleState.ACTIVATED, 5)
    assert (done.state, done.data, done.done_at_ms, done.ordering_key) == (
        ScheduleState.ACTIVATED, b"", 5, message.ordering_key)
    assert ScheduledMessage.decode(done.encode()) == done


def test_record_decode_refuses_other_bytes() -> None:
    with pytest.raises(RecordFormatError):
        ScheduledMessage.decode(b"\xff\xff\xff")


def test_enqueue_at_must_be_timezone_aware() -> None:
    with pytest.raises(ConfigError):
        epoch_ms(datetime(2030, 1, 1))
    assert epoch_ms(datetime(1970, 1, 1, 0, 0, 1, tzinfo=UTC)) == 1000


def test_index_keys_share_one_hash_slot() -> None:
    keys = index_keys("__ordering_layer_schedules")
    assert len(set(keys)) == 6
    assert {k[k.index("{"):k.index("}") + 1] for k in keys} == {"{sched:__ordering_layer_schedules}"}


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError):
        SchedulerSettings(lease=0)
    with pytest.raises(ConfigError):
        SchedulerSettings(batch=0)
    with pytest.raises(ConfigError, match="unknown"):
        from_mapping(SchedulerSettings, {"leases": 3})
    assert from_mapping(PublisherSettings, {"scheduler": False}).scheduler is False


def test_parse_when() -> None:
    now = datetime(2030, 1, 1, tzinfo=UTC)
    assert parse_when(None, 60, now) == now + timedelta(minutes=1)
    assert parse_when("2030-01-02T03:04:05", None, now) == datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert parse_when("2030-01-02T03:04:05+01:00", None, now).utcoffset() == timedelta(hours=1)
    for at, delay in ((None, None), ("2030-01-01", 5.0)):
        with pytest.raises(click.UsageError):
            parse_when(at, delay, now)
    with pytest.raises(click.BadParameter):
        parse_when("tomorrow", None, now)


def test_render_table() -> None:
    assert render_table(["ID", "TOPIC"], [["a", "orders"], ["bbbb", "t"]]).splitlines() == [
        "ID    TOPIC", "----  ------", "a     orders", "bbbb  t"]
    assert render_table(["ID"], []).splitlines() == ["ID", "--"]


def test_schedule_without_subcommand_means_publish() -> None:
    result = CliRunner().invoke(schedule, ["orders", "--data", "x"])
    assert result.exit_code == 2
    assert "give exactly one of --at and --in" in result.output
    assert "cancel" in CliRunner().invoke(schedule, ["--help"]).output


def test_schedule_without_redis_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer without a Redis URL does not take part in activation, and schedule() says why."""
    monkeypatch.delenv("ORDERING_LAYER_REDIS_URL", raising=False)
    with OrderedProducer({"bootstrap.servers": "127.0.0.1:1"}) as producer:
        with pytest.raises(ConfigError, match="redis_url"):
            producer.schedule("t", b"x", enqueue_at=datetime.now(UTC))
        with pytest.raises(ConfigError, match="redis_url"):
            producer.cancel_scheduled("id")
