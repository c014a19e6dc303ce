"""Per-key order restoring on pandas frames: the logic Spark runs in its Python workers (SPK-2, SPK-3).

A frame holds decoded records (``ordering_layer.spark.reader`` columns) of one or many ordering
keys, every row with a non-null ``ordering_key``. For each key the messages are put in sequence
order, duplicates of a message id are dropped (the first in sequence order is kept), the rest are
numbered, and a message is flagged as following a gap when the source holds a record of its key
that cannot be delivered just before it. The work is done on NumPy arrays for the whole frame at
once, so one Python call serves many keys cheaply.

Sequence order (PUB-6) is ``(partition_count, offset)``: a key lives in one partition per
partition count, and counts only grow. One refinement makes it well defined for copies: a record
written to a partition other than the one its stamped count routes its key to (a retry or redrive
by a plain Kafka producer after partitions were added) sorts after the key's correctly routed
records of that count, so its offset is never compared with offsets of another partition.

Gaps. Offsets of a partition are shared by all keys, and the envelope carries no per-key counter,
so the data can prove a message of a key missing only when the missing message is there but
undecodable: a record with the key's Kafka key whose value or headers cannot be decoded (DLQ-4).
Such a record is placed in the key's sequence by its stamped partition count (or, when that header
is unreadable, by the count of the key's nearest message in the same partition) and its offset;
the next delivered message of the key gets ``gap = True``. An undecodable copy of a message that
is delivered (same message id) is not a gap. Not detectable, and so never flagged: a message that
never reached Kafka (a failed publish pauses its key, PUB-2), records removed by retention before
the read, and offsets absent from a partition (compaction, transaction markers), which belong to
no known key.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from ordering_layer.publisher.partitioner import partition_for

_LOGGER = logging.getLogger(__name__)

KEY = "ordering_key"
KEY_SEQUENCE = "key_sequence"
GAP = "gap"
LATE = "late"
# Kinds of entries in a key's sequence; the value breaks ties at one position: the previous
# batch's last message first, then a gap carried over from after it.
_PREVIOUS, _CARRIED_GAP, _MESSAGE, _UNDECODABLE = 0, 1, 2, 3

Array = np.ndarray[Any, Any]


class KeyProgress(NamedTuple):
    """Where one key stands after earlier micro-batches (the streaming state, SPK-3).

    Attributes:
        emitted: messages of the key emitted so far (the last ``key_sequence``).
        partition_count, rerouted, offset, partition: sequence position of the last emitted
            message; None before the first.
        pending_gap: an undecodable record of the key came after the last emitted message, so
            the next one follows a gap.
        seen_ids: message ids emitted most recently (bounded), to drop later duplicates.
    """

    emitted: int
    partition_count: int | None
    rerouted: bool | None
    offset: int | None
    partition: int | None
    pending_gap: bool
    seen_ids: tuple[str, ...]


class Restored(NamedTuple):
    """What ``restore_frame`` returns.

    Attributes:
        messages: the delivered messages with ``key_sequence``, ``gap`` and ``late`` added.
        progress: per key, the new ``KeyProgress`` (``seen_ids`` extended by the emitted ids and
            cut to ``keep_ids``); only filled when ``track`` was true.
    """

    messages: pd.DataFrame
    progress: dict[str, KeyProgress]


class _Entries(NamedTuple):
    """Entries of key sequences as parallel arrays (one element per entry)."""

    code: Array             # the key's code (keys factorized in sorted order)
    partition_count: Array  # partition count at publish
    rerouted: Array         # not in the partition its count routes its key to
    offset: Array
    partition: Array
    kind: Array             # _PREVIOUS, _CARRIED_GAP, _MESSAGE or _UNDECODABLE
    row: Array              # row of the records, -1 for entries from progress

    @staticmethod
    def concat(parts: list[_Entries]) -> _Entries:
        return _Entries(*(np.concatenate(columns) for columns in zip(*parts, strict=True)))

    def take(self, index: Array) -> _Entries:
        return _Entries(*(column[index] for column in self))

    def sorted(self) -> _Entries:
        """In sequence order: key, partition count, correctly routed first, offset, kind."""
        return self.take(np.lexsort((self.kind, self.offset, self.rerouted, self.partition_count, self.code)))


def _rerouted(keys: Array, counts: Array, partitions: Array) -> Array:
    """True where a record is not in the partition its stamped count routes its key to."""
    home: dict[tuple[str, int], int] = {}
    flags = np.empty(len(keys), dtype=bool)
    for i, (key, count, partition) in enumerate(zip(keys, counts.tolist(), partitions.tolist(), strict=True)):
        pair = (key, int(count))
        found = home.get(pair)
        if found is None:
            found = home[pair] = partition_for(key.encode("utf-8"), pair[1])
        flags[i] = found != partition
    return flags


def _cumsum_by_group(values: Array, codes: Array) -> Array:
    """Inclusive running sum of non-negative ``values`` restarting where sorted ``codes`` change."""
    total = np.cumsum(values)
    if len(values) == 0:
        return total
    start = np.r_[True, codes[1:] != codes[:-1]]
    return total - np.maximum.accumulate(np.where(start, total - values, 0))


def _previous_entries(progress: Mapping[str, KeyProgress], codes: Mapping[str, int]) -> _Entries:
    """Stand-ins for each key's last emitted message, and for a gap carried from after it."""
    rows: list[tuple[int, int, bool, int, int, int]] = []
    for key, code in codes.items():
        state = progress.get(key)
        if state is None:
            continue
        if state.offset is not None:
            position = (int(state.partition_count or 0), bool(state.rerouted), state.offset, int(state.partition or 0))
            rows.append((code, *position, _PREVIOUS))
        else:
            position = (-1, False, -1, -1)
        if state.pending_gap:
            rows.append((code, *position, _CARRIED_GAP))
    table = np.array(rows, dtype=np.int64).reshape(len(rows), 6)
    return _Entries(table[:, 0], table[:, 1], table[:, 2].astype(bool), table[:, 3], table[:, 4], table[:, 5],
                    np.full(len(rows), -1, dtype=np.int64))


def _place_unknown_counts(errors: _Entries, anchors: _Entries) -> _Entries:
    """Undecodable records with an unreadable partition count take the count of their key's nearest
    message in the same partition (earlier first, else later); those with none are dropped."""
    unknown = np.isnan(errors.partition_count)
    if not unknown.any():
        return errors
    reference = pd.DataFrame({"code": anchors.code, "partition": anchors.partition, "offset": anchors.offset,
                              "count": anchors.partition_count.astype(float)}).sort_values("offset")
    probe = pd.DataFrame({"code": errors.code[unknown], "partition": errors.partition[unknown],
                          "offset": errors.offset[unknown], "at": np.flatnonzero(unknown)}).sort_values("offset")
    before = pd.merge_asof(probe, reference, on="offset", by=["code", "partition"], direction="backward")
    after = pd.merge_asof(probe, reference, on="offset", by=["code", "partition"], direction="forward")
    count = errors.partition_count.copy()
    count[before["at"].to_numpy()] = before["count"].fillna(after["count"]).to_numpy()
    placed = errors._replace(partition_count=count)
    return placed.take(np.flatnonzero(~np.isnan(count)))


class Records(NamedTuple):
    """The columns of decoded records that order restoring reads, as arrays (one element per row).

    ``ordering_key`` and ``message_id`` are object arrays (None or NaN for null), ``partition_count``
    is float (NaN when unreadable), ``broken`` is true for undecodable records.
    """

    ordering_key: Array
    message_id: Array
    partition: Array
    offset: Array
    partition_count: Array
    broken: Array

    @staticmethod
    def of(frame: pd.DataFrame) -> Records:
        """The arrays of a pandas frame with the ``read_ordered`` columns."""
        return Records(frame[KEY].to_numpy(dtype=object), frame["message_id"].to_numpy(dtype=object),
                       frame["partition"].to_numpy(dtype=np.int64), frame["offset"].to_numpy(dtype=np.int64),
                       pd.to_numeric(frame["partition_count"]).to_numpy(dtype=float, na_value=np.nan),
                       frame["error"].notna().to_numpy())


class Plan(NamedTuple):
    """What order restoring makes of a set of records; apply it with ``rows`` (``take``).

    Attributes:
        rows: the records delivered, in output order: each key's messages in sequence order (keys
            sorted), then the unordered messages, one per message id.
        key_sequence: per output row, 1-based number within its key (0 for unordered rows).
        ordered: per output row, whether it has a key (``key_sequence`` is null where not).
        gap: per output row, an undecodable record of the key comes just before it.
        late: per output row, it sorts before a message an earlier micro-batch emitted.
        progress: per key, the new ``KeyProgress`` (only when asked to track).
    """

    rows: Array
    key_sequence: Array
    ordered: Array
    gap: Array
    late: Array
    progress: dict[str, KeyProgress]


def plan_restore(records: Records, progress: Mapping[str, KeyProgress] | None = None, *,
                 track: bool = False, keep_ids: int = 1000) -> Plan:
    """Restore per-key order over ``records`` of any number of keys.

    Undecodable records are never delivered; they only mark gaps. Records without a key are
    unordered messages, delivered once per message id.

    Args:
        records: the records' columns.
        progress: per key, where earlier micro-batches left it (streaming); keys not in it start
            fresh: numbering continues from ``emitted``, ids in ``seen_ids`` are dropped.
        track: also compute each key's new ``KeyProgress``.
        keep_ids: how many recent message ids of a key the new progress remembers.
    """
    progress = progress or {}
    keys, message_ids, partitions, offsets, counts, broken = records
    codes, uniques = pd.factorize(keys, sort=True)  # a null key gets code -1
    has_key = codes >= 0

    good = np.flatnonzero(~broken & has_key)
    seen = {key: set(state.seen_ids) for key, state in progress.items() if state.seen_ids}
    if seen:
        fresh = [message_ids[i] not in seen.get(keys[i], ()) for i in good]
        good = good[np.asarray(fresh, dtype=bool)]
    entries = _Entries(codes[good], counts[good], _rerouted(keys[good], counts[good], partitions[good]),
                       offsets[good], partitions[good], np.full(len(good), _MESSAGE), good).sorted()
    # First of each (key, message id) in sequence order.
    id_codes, _ = pd.factorize(message_ids[entries.row])
    _, first = np.unique(entries.code * (len(keys) + 1) + id_codes, return_index=True)
    messages = entries.take(np.sort(first))

    in_progress = {key: code for code, key in enumerate(uniques) if key in progress} if progress else {}
    anchors = _Entries.concat([messages, _previous_entries(progress, in_progress)])
    sequence = anchors
    undecodable = np.flatnonzero(broken & has_key)
    if len(undecodable):
        delivered = {(keys[i], message_ids[i]) for i in messages.row}
        delivered.update((key, message_id) for key, ids in seen.items() for message_id in ids)
        undecodable = undecodable[np.asarray([(keys[i], message_ids[i]) not in delivered for i in undecodable],
                                             dtype=bool)]
        errors = _place_unknown_counts(_Entries(
            codes[undecodable], counts[undecodable], np.zeros(len(undecodable), dtype=bool), offsets[undecodable],
            partitions[undecodable], np.full(len(undecodable), _UNDECODABLE), undecodable), anchors)
        errors = errors._replace(rerouted=_rerouted(keys[errors.row], errors.partition_count, errors.partition))
        sequence = _Entries.concat([anchors, errors])
    sequence = sequence.sorted()

    marks_gap = (sequence.kind == _UNDECODABLE) | (sequence.kind == _CARRIED_GAP)
    gaps_so_far = _cumsum_by_group(marks_gap.astype(np.int64), sequence.code)
    is_anchor = (sequence.kind == _MESSAGE) | (sequence.kind == _PREVIOUS)
    anchor_codes = sequence.code[is_anchor]
    anchor_gaps = gaps_so_far[is_anchor]
    first_of_key = np.r_[True, anchor_codes[1:] != anchor_codes[:-1]][:len(anchor_codes)]
    gaps_before = np.where(first_of_key, 0, np.r_[0, anchor_gaps[:-1]][:len(anchor_codes)])
    gap = (anchor_gaps - gaps_before)[sequence.kind[is_anchor] == _MESSAGE] > 0

    is_previous = sequence.kind == _PREVIOUS
    after_previous = _cumsum_by_group(is_previous.astype(np.int64), sequence.code)
    is_message = sequence.kind == _MESSAGE
    late = (np.isin(sequence.code, sequence.code[is_previous]) & (after_previous == 0))[is_message]
    message_codes = sequence.code[is_message]
    numbers = _cumsum_by_group(np.ones(len(message_codes), dtype=np.int64), message_codes)
    if progress:
        emitted = np.array([progress[key].emitted if key in progress else 0 for key in uniques], dtype=np.int64)
        numbers = numbers + emitted[message_codes]
    delivered_rows = sequence.row[is_message]

    loose = np.flatnonzero(~broken & ~has_key)
    _, first_loose = np.unique(pd.factorize(message_ids[loose])[0], return_index=True)
    loose = loose[np.sort(first_loose)]
    unordered = np.zeros(len(loose), dtype=bool)
    tracked = (_progress(sequence, gaps_so_far, keys[delivered_rows], message_ids[delivered_rows], uniques, progress,
                         keep_ids) if track else {})
    return Plan(np.r_[delivered_rows, loose], np.r_[numbers, np.zeros(len(loose), dtype=np.int64)],
                np.r_[np.ones(len(numbers), dtype=bool), unordered], np.r_[gap, unordered], np.r_[late, unordered],
                tracked)


def restore_frame(frame: pd.DataFrame, progress: Mapping[str, KeyProgress] | None = None, *,
                  track: bool = False, keep_ids: int = 1000) -> Restored:
    """``plan_restore`` applied to a pandas frame of decoded records (``read_ordered`` columns).

    Returns:
        The delivered rows (keys' messages in sequence order, then the unordered ones), without
        ``error``, with ``key_sequence`` (null for unordered messages), ``gap`` and ``late``; and
        the progress when ``track``.
    """
    plan = plan_restore(Records.of(frame), progress, track=track, keep_ids=keep_ids)
    result = frame.iloc[plan.rows].drop(columns=["error"]).reset_index(drop=True)
    result[KEY_SEQUENCE] = pd.arrays.IntegerArray(plan.key_sequence, ~plan.ordered)
    result[GAP] = plan.gap
    result[LATE] = plan.late
    return Restored(result, plan.progress)


def _progress(sequence: _Entries, gaps_so_far: Array, delivered_keys: Array, delivered_ids: Array, uniques: Array,
              progress: Mapping[str, KeyProgress], keep_ids: int) -> dict[str, KeyProgress]:
    """Each key's ``KeyProgress`` after these records: last position, count, recent ids, open gap."""
    emitted_ids: dict[str, list[str]] = {}
    for key, message_id in zip(delivered_keys, delivered_ids, strict=True):
        emitted_ids.setdefault(key, []).append(message_id)
    tracked: dict[str, KeyProgress] = {}
    for code in np.unique(sequence.code).tolist():
        key = uniques[code]
        before = progress.get(key, KeyProgress(0, None, None, None, None, False, ()))
        ids = emitted_ids.get(key, [])
        recent = (*before.seen_ids, *ids)[-keep_ids:] if keep_ids > 0 else ()
        mine = np.flatnonzero(sequence.code == code)
        anchors = mine[(sequence.kind[mine] == _MESSAGE) | (sequence.kind[mine] == _PREVIOUS)]
        if len(anchors):
            last = anchors[-1]
            tracked[key] = KeyProgress(
                before.emitted + len(ids), int(sequence.partition_count[last]), bool(sequence.rerouted[last]),
                int(sequence.offset[last]), int(sequence.partition[last]),
                bool(gaps_so_far[mine[-1]] > gaps_so_far[last]), recent)
        else:
            tracked[key] = KeyProgress(before.emitted, None, None, None, None, bool(gaps_so_far[mine[-1]] > 0),
                                       recent)
    return tracked
