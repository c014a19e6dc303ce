"""The prober's events: attribute parsing, JSON lines, and the folder of per-process event files."""

from __future__ import annotations

from pathlib import Path

import pytest

from ordering_layer.errors import ConfigError
from ordering_layer.prober.eventlog import EventFolderReader, EventLog
from ordering_layer.prober.events import (
    ACK,
    ACK_OK,
    DeadLettered,
    Delivery,
    Event,
    Expectation,
    Fault,
    Lost,
    ProbeFields,
    Settlement,
    from_json,
    probe_fields,
    to_json,
)


def delivery(at: float, sub: str = "s1", seq: int = 0) -> Delivery:
    return Delivery(at, sub, 1, None, "k", "r", seq, "m", 1, at - 0.01)


def test_probe_fields_from_attributes() -> None:
    """The prober's metadata is read from attributes (headers); records without it are unverified."""
    assert probe_fields({"prober-run": "r1", "prober-seq": "7", "prober-published": "12.5"}) == \
        ProbeFields("r1", 7, 12.5)
    assert probe_fields({"prober-run": "r1", "prober-seq": "7"}) == ProbeFields("r1", 7, None)
    assert probe_fields({"prober-seq": "7"}) is None
    assert probe_fields({"prober-run": "r1", "prober-seq": "x"}) is None
    assert probe_fields({"prober-run": "r1", "prober-seq": "-1"}) is None
    assert probe_fields({}) is None


def test_events_round_trip_as_json_lines() -> None:
    """Every event type survives to_json/from_json; junk is refused with ConfigError."""
    events: list[Event] = [delivery(1.0), Settlement(2.0, "s1", 1, "k", "r", 0, 1, ACK), Fault(3.0, "redis-flushall"),
              Expectation(4.0, "r", "k", 10), Delivery(5.0, "s1", 2, 3, "k", None, None, "m2", 1, None)]
    for event in events:
        line = to_json(event)
        assert "\n" not in line
        assert from_json(line) == event
    for junk in ("{", '{"ev": "nope"}', '{"ev": "fault"}', '{"ev": "settle", "at": 1, "subscriber": "s", '
                 '"delivery": 1, "key": "k", "run": "r", "seq": 0, "attempt": 1, "outcome": "maybe"}'):
        with pytest.raises(ConfigError):
            from_json(junk)


def test_folder_reader_merges_files_in_time_order(tmp_path: Path) -> None:
    """Events of several writers come out merged by time, held back ``lag`` seconds; files that
    appear later are picked up; a partial last line waits for its newline."""
    a = EventLog(tmp_path / "a.jsonl")
    b = EventLog(tmp_path / "b.jsonl")
    reader = EventFolderReader(tmp_path, lag=1.0)
    a(delivery(10.0, "a"))
    a(delivery(12.0, "a"))
    b(delivery(11.0, "b"))
    assert [e.at for e in reader.poll(now=11.5)] == [10.0]
    assert [e.at for e in reader.poll(now=13.0)] == [11.0, 12.0]
    with open(tmp_path / "c.jsonl", "w") as late_writer:
        late_writer.write(to_json(delivery(14.0, "c")) + "\n" + to_json(delivery(15.0, "c"))[:20])
    assert [e.at for e in reader.poll(now=20.0)] == [14.0]
    b(delivery(11.5, "b"))  # older than what was released: counted as late
    assert [e.at for e in reader.drain()] == [11.5]
    assert reader.late == 1
    a.close()
    b.close()
    reader.close()


def test_folder_reader_skips_malformed_lines(tmp_path: Path) -> None:
    """A torn or foreign line is counted and skipped; the events around it are kept."""
    (tmp_path / "x.jsonl").write_text(to_json(delivery(1.0)) + "\nnot json\n" + to_json(delivery(2.0)) + "\n")
    reader = EventFolderReader(tmp_path, lag=0.0)
    assert [e.at for e in reader.drain()] == [1.0, 2.0]
    assert reader.malformed == 1
    reader.close()


def test_harness_events_round_trip() -> None:
    """A lost subscriber, a dead letter found in the topic and a confirmed ack survive JSON lines."""
    events: list[Event] = [Lost(1.5, "sub-2"), DeadLettered(2.0, "r", "k", 7, 5),
                           Settlement(3.0, "s1", 4, "k", "r", 3, 1, ACK_OK)]
    assert [from_json(to_json(e)) for e in events] == events
    assert from_json('{"ev":"lost","at":9,"subscriber":"x"}') == Lost(9, "x")
