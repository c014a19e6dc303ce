"""Per-key order restoring on arrays: the logic Spark runs in its Python workers (SPK-2, SPK-3, PUB-7).

The input is records (``ordering_layer.spark.reader`` columns) of any number of ordering keys. A
key is the exact bytes of the record key (two keys that differ in any byte are two keys, whatever
their text form). For each key the messages are put in sequence order, duplicates of a message id
are dropped (the first in sequence order is kept), and the rest are numbered. The work is done on
NumPy arrays for all keys at once, so one Python call serves many keys cheaply.

Sequence order (PUB-6) is ``(partition_count, offset)`` for records that carry the
``ol-partition-count`` header: a key lives in one partition per partition count, and counts only
grow. One refinement makes it well defined for copies: a record in a partition other than the one
its stamped count routes its key to (a retry or redrive by a plain Kafka producer after partitions
were added) sorts after the key's correctly routed records of that count, so its offset is never
compared with offsets of another partition.

Records without the header (another producer's, or a malformed header ignored, PUB-7) sort by
offset within their partition only. Such a record takes its place between its key's headered
neighbours in the same partition (by offset) when those two are adjacent in the key's headered
sequence (or it comes first or last, next to the sequence's first or last message); records
without the header that fall in one place must share a partition. Where that does not place every
record of a key, the key's order is not defined by the data: all its messages are still emitted,
numbered in a fixed order (headered sequence, then the unplaced records by partition and offset),
with ``order_undefined`` set, instead of a guess passed off as the order. A key written only by a
plain producer with Kafka's default partitioner (one partition per key) is thus ordered by offset;
one whose records sit in two partitions without the header is flagged.

In streaming, the previous micro-batches of a key are represented by the last message emitted
(``KeyProgress``): new records are placed after it by the same rules; one that sorts before it is
emitted with the next number and ``late`` set; once flagged, a key stays flagged.

Records without a key are unordered messages, emitted once per message id. A message id without
the ``ol-message-id`` header is the record's sequence number, so only records that carry the same
id header (copies written by retries and redrives) are duplicates.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from ordering_layer.kafka.partitioner import partition_for

_LOGGER = logging.getLogger(__name__)

KEY = "key"
KEY_SEQUENCE = "key_sequence"
ORDER_UNDEFINED = "order_undefined"
LATE = "late"
# Kinds of entries in a key's sequence: the last message of earlier micro-batches, or a record.
_PREVIOUS, _MESSAGE = 0, 1

Array = np.ndarray[Any, Any]


class KeyProgress(NamedTuple):
    """Where one key stands after earlier micro-batches (the streaming state, SPK-3).

    Attributes:
        emitted: messages of the key emitted so far (the last ``key_sequence``).
        partition_count, rerouted, offset, partition: sequence position of the last emitted
            message (``partition_count`` None: it had no header); all None before the first.
        order_undefined: the key's order was found undefined (PUB-7); it stays so.
        seen_ids: message ids emitted most recently (bounded), to drop later duplicates.
    """

    emitted: int
    partition_count: int | None
    rerouted: bool | None
    offset: int | None
    partition: int | None
    order_undefined: bool
    seen_ids: tuple[str, ...]


class Records(NamedTuple):
    """The columns that order restoring reads, as arrays (one element per record).

    ``key`` is an object array of bytes (None: unordered), ``message_id`` an object array,
    ``partition_count`` float (NaN: no header).
    """

    key: Array
    message_id: Array
    partition: Array
    offset: Array
    partition_count: Array

    @staticmethod
    def of(frame: pd.DataFrame) -> Records:
        """The arrays of a pandas frame with the ``read_ordered`` columns."""
        return Records(keys_of(frame[KEY].to_numpy(dtype=object)), frame["message_id"].to_numpy(dtype=object),
                       frame["partition"].to_numpy(dtype=np.int64), frame["offset"].to_numpy(dtype=np.int64),
                       pd.to_numeric(frame["partition_count"]).to_numpy(dtype=float, na_value=np.nan))


def keys_of(values: Array) -> Array:
    """Keys as bytes (Spark may hand binary values over as ``bytearray``), None where null."""
    return np.array([bytes(value) if isinstance(value, bytes | bytearray | memoryview) else None for value in values],
                    dtype=object)


class Plan(NamedTuple):
    """What order restoring makes of a set of records; apply it with ``rows`` (``take``).

    Attributes:
        rows: the records emitted, in output order: each key's messages in sequence order (keys
            sorted by their bytes), then the unordered messages, one per message id.
        key_sequence: per output row, 1-based number within its key (0 for unordered rows).
        ordered: per output row, whether it has a key (``key_sequence`` is null where not).
        order_undefined: per output row, its key's order is not defined by the data (PUB-7).
        late: per output row, it sorts before a message an earlier micro-batch emitted.
        progress: per key, the new ``KeyProgress`` (only when asked to track).
    """

    rows: Array
    key_sequence: Array
    ordered: Array
    order_undefined: Array
    late: Array
    progress: dict[bytes, KeyProgress]


class _Entries(NamedTuple):
    """Entries of key sequences as parallel arrays (one element per entry)."""

    code: Array             # the key's code (keys factorized in sorted order)
    partition_count: Array  # partition count at publish, NaN without the header
    rerouted: Array         # not in the partition its count routes its key to
    offset: Array
    partition: Array
    kind: Array             # _PREVIOUS or _MESSAGE
    row: Array              # row of the records, -1 for the previous micro-batches' last message

    @staticmethod
    def concat(parts: list[_Entries]) -> _Entries:
        return _Entries(*(np.concatenate(columns) for columns in zip(*parts, strict=True)))

    def take(self, index: Array) -> _Entries:
        return _Entries(*(column[index] for column in self))

    @property
    def length(self) -> int:
        """How many entries (``len`` is the number of fields, as for any tuple)."""
        return len(self.code)


def _rerouted(keys: Array, counts: Array, partitions: Array) -> Array:
    """True where a record is not in the partition its stamped count routes its key to."""
    home: dict[tuple[bytes, int], int] = {}
    flags = np.empty(len(keys), dtype=bool)
    for i, (key, count, partition) in enumerate(zip(keys, counts.tolist(), partitions.tolist(), strict=True)):
        pair = (key, int(count))
        found = home.get(pair)
        if found is None:
            found = home[pair] = partition_for(key, pair[1])
        flags[i] = found != partition
    return flags


def _cumsum_by_group(values: Array, codes: Array) -> Array:
    """Inclusive running sum of non-negative ``values`` restarting where sorted ``codes`` change."""
    total = np.cumsum(values)
    if len(values) == 0:
        return total
    start = np.r_[True, codes[1:] != codes[:-1]]
    return total - np.maximum.accumulate(np.where(start, total - values, 0))


def _previous_entries(progress: Mapping[bytes, KeyProgress], codes: Mapping[bytes, int]) -> _Entries:
    """Stand-ins for each key's last emitted message."""
    rows = [(code, np.nan if state.partition_count is None else state.partition_count, bool(state.rerouted),
             state.offset, int(state.partition or 0))
            for key, code in codes.items() if (state := progress.get(key)) is not None and state.offset is not None]
    table = np.array(rows, dtype=float).reshape(len(rows), 5)
    return _Entries(table[:, 0].astype(np.int64), table[:, 1], table[:, 2].astype(bool),
                    np.array([row[3] for row in rows], dtype=np.int64), table[:, 4].astype(np.int64),
                    np.full(len(rows), _PREVIOUS, dtype=np.int64), np.full(len(rows), -1, dtype=np.int64))


def _first_of_each_id(entries: _Entries, message_ids: Array, keys: int) -> _Entries:
    """Of entries sorted in sequence order, the first of each (key, message id)."""
    id_codes, _ = pd.factorize(message_ids[entries.row])
    _, first = np.unique(entries.code * (keys + 1) + id_codes, return_index=True)
    return entries.take(np.sort(first))


def _place_headerless(headered: _Entries, headerless: _Entries, keys: int) -> tuple[Array, Array]:
    """Where records without the partition-count header go in their key's sequence (PUB-7).

    Args:
        headered: the headered entries of every key, in sequence order.
        headerless: the entries without the header.
        keys: how many keys (codes are ``0..keys-1``).

    Returns:
        ``slot`` per headerless entry: the rank in its key's headered sequence of the entry it
        follows (-1: before all), or -2 when it cannot be placed; and ``undefined`` per key code.
    """
    undefined = np.zeros(keys, dtype=bool)
    if headerless.length == 0:
        return np.zeros(0, dtype=np.int64), undefined
    rank = _cumsum_by_group(np.ones(headered.length, dtype=np.int64), headered.code) - 1
    size = np.bincount(headered.code, minlength=keys)
    reference = pd.DataFrame({"code": headered.code, "partition": headered.partition, "offset": headered.offset,
                              "rank": rank}).sort_values("offset", kind="stable")
    probe = pd.DataFrame({"code": headerless.code, "partition": headerless.partition, "offset": headerless.offset,
                          "at": np.arange(headerless.length)}).sort_values("offset", kind="stable")
    before = pd.merge_asof(probe, reference, on="offset", by=["code", "partition"], direction="backward",
                           allow_exact_matches=False).sort_values("at")
    after = pd.merge_asof(probe, reference, on="offset", by=["code", "partition"], direction="forward",
                          allow_exact_matches=False).sort_values("at")
    previous = before["rank"].fillna(-1).to_numpy(dtype=np.int64)
    following = after["rank"].fillna(-1).to_numpy(dtype=np.int64)
    following = np.where(following < 0, size[headerless.code], following)
    slot = np.where(following == previous + 1, previous, -2)
    placed = slot > -2
    # Records placed in one slot must share a partition: offsets of two partitions do not compare.
    shared = pd.DataFrame({"code": headerless.code[placed], "slot": slot[placed],
                           "partition": headerless.partition[placed]})
    mixed = shared.groupby(["code", "slot"])["partition"].nunique()
    undefined[mixed[mixed > 1].index.get_level_values("code").to_numpy(dtype=np.int64)] = True
    undefined[headerless.code[~placed]] = True
    return slot, undefined


def plan_restore(records: Records, progress: Mapping[bytes, KeyProgress] | None = None, *,
                 track: bool = False, keep_ids: int = 1000) -> Plan:
    """Restore per-key order over ``records`` of any number of keys (see the module docstring).

    Args:
        records: the records' columns.
        progress: per key, where earlier micro-batches left it (streaming); keys not in it start
            fresh: numbering continues from ``emitted``, ids in ``seen_ids`` are dropped.
        track: also compute each key's new ``KeyProgress``.
        keep_ids: how many recent message ids of a key the new progress remembers.
    """
    progress = progress or {}
    keys, message_ids, partitions, offsets, counts = records
    codes, uniques = pd.factorize(keys, sort=True)  # a null key gets code -1
    has_key = codes >= 0

    keyed = np.flatnonzero(has_key)
    seen = {key: set(state.seen_ids) for key, state in progress.items() if state.seen_ids}
    if seen:
        fresh = [message_ids[i] not in seen.get(keys[i], ()) for i in keyed]
        keyed = keyed[np.asarray(fresh, dtype=bool)]
    counted = ~np.isnan(counts[keyed])
    stamped, plain = keyed[counted], keyed[~counted]
    entries = _Entries(codes[stamped], counts[stamped], _rerouted(keys[stamped], counts[stamped], partitions[stamped]),
                       offsets[stamped], partitions[stamped], np.full(len(stamped), _MESSAGE, dtype=np.int64),
                       stamped)
    entries = entries.take(np.lexsort((entries.offset, entries.rerouted, entries.partition_count, entries.code)))
    entries = _first_of_each_id(entries, message_ids, len(keys))
    in_progress = {key: code for code, key in enumerate(uniques) if key in progress} if progress else {}
    previous = _previous_entries(progress, in_progress)
    previous_stamped = ~np.isnan(previous.partition_count)
    headered = _Entries.concat([entries, previous.take(np.flatnonzero(previous_stamped))])
    headered = headered.take(np.lexsort((headered.kind, headered.offset, headered.rerouted,
                                         headered.partition_count, headered.code)))
    headerless = _Entries.concat([
        _Entries(codes[plain], counts[plain], np.zeros(len(plain), dtype=bool), offsets[plain], partitions[plain],
                 np.full(len(plain), _MESSAGE, dtype=np.int64), plain),
        previous.take(np.flatnonzero(~previous_stamped))])
    slot, undefined = _place_headerless(headered, headerless, len(uniques))
    for key, code in in_progress.items():
        undefined[code] |= progress[key].order_undefined

    rank = _cumsum_by_group(np.ones(headered.length, dtype=np.int64), headered.code) - 1
    size = np.bincount(headered.code, minlength=len(uniques))
    position = np.r_[2 * rank + 1, np.where(slot > -2, 2 * slot + 2, 2 * size[headerless.code] + 2)]
    sequence = _Entries.concat([headered, headerless])
    order = np.lexsort((sequence.offset, sequence.partition, position, sequence.code))
    sequence = sequence.take(order)

    is_previous = sequence.kind == _PREVIOUS
    after_previous = _cumsum_by_group(is_previous.astype(np.int64), sequence.code)
    is_message = ~is_previous
    late = (np.isin(sequence.code, sequence.code[is_previous]) & (after_previous == 0))[is_message]
    message_codes = sequence.code[is_message]
    numbers = _cumsum_by_group(np.ones(len(message_codes), dtype=np.int64), message_codes)
    if progress:
        emitted = np.array([progress[key].emitted if key in progress else 0 for key in uniques], dtype=np.int64)
        numbers = numbers + emitted[message_codes]
    emitted_rows = sequence.row[is_message]

    loose = np.flatnonzero(~has_key)
    _, first_loose = np.unique(pd.factorize(message_ids[loose])[0], return_index=True)
    loose = loose[np.sort(first_loose)]
    unordered = np.zeros(len(loose), dtype=bool)
    tracked = (_progress(sequence, undefined, keys[emitted_rows], message_ids[emitted_rows], uniques, progress,
                         keep_ids) if track else {})
    return Plan(np.r_[emitted_rows, loose], np.r_[numbers, np.zeros(len(loose), dtype=np.int64)],
                np.r_[np.ones(len(numbers), dtype=bool), unordered], np.r_[undefined[message_codes], unordered],
                np.r_[late, unordered], tracked)


class Restored(NamedTuple):
    """What ``restore_frame`` returns.

    Attributes:
        messages: the emitted messages with ``key_sequence``, ``order_undefined`` and ``late``.
        progress: per key, the new ``KeyProgress`` (``seen_ids`` extended by the emitted ids and
            cut to ``keep_ids``); only filled when ``track`` was true.
    """

    messages: pd.DataFrame
    progress: dict[bytes, KeyProgress]


def restore_frame(frame: pd.DataFrame, progress: Mapping[bytes, KeyProgress] | None = None, *,
                  track: bool = False, keep_ids: int = 1000) -> Restored:
    """``plan_restore`` applied to a pandas frame of records (``read_ordered`` columns).

    Returns:
        The emitted rows (keys' messages in sequence order, then the unordered ones), with
        ``key_sequence`` (null for unordered messages), ``order_undefined`` and ``late``; and the
        progress when ``track``.
    """
    plan = plan_restore(Records.of(frame), progress, track=track, keep_ids=keep_ids)
    result = frame.iloc[plan.rows].reset_index(drop=True)
    result[KEY_SEQUENCE] = pd.arrays.IntegerArray(plan.key_sequence, ~plan.ordered)
    result[ORDER_UNDEFINED] = plan.order_undefined
    result[LATE] = plan.late
    return Restored(result, plan.progress)


def _progress(sequence: _Entries, undefined: Array, emitted_keys: Array, emitted_ids: Array, uniques: Array,
              progress: Mapping[bytes, KeyProgress], keep_ids: int) -> dict[bytes, KeyProgress]:
    """Each key's ``KeyProgress`` after these records: last position, count, recent ids, flag."""
    emitted: dict[bytes, list[str]] = {}
    for key, message_id in zip(emitted_keys, emitted_ids, strict=True):
        emitted.setdefault(key, []).append(message_id)
    tracked: dict[bytes, KeyProgress] = {}
    if sequence.length == 0:
        return tracked
    last_of_key = np.flatnonzero(np.r_[sequence.code[1:] != sequence.code[:-1], True])
    for last in last_of_key.tolist():
        code = int(sequence.code[last])
        key = uniques[code]
        before = progress.get(key, KeyProgress(0, None, None, None, None, False, ()))
        ids = emitted.get(key, [])
        recent = (*before.seen_ids, *ids)[-keep_ids:] if keep_ids > 0 else ()
        count = sequence.partition_count[last]
        tracked[key] = KeyProgress(before.emitted + len(ids), None if np.isnan(count) else int(count),
                                   bool(sequence.rerouted[last]), int(sequence.offset[last]),
                                   int(sequence.partition[last]), bool(undefined[code]), recent)
    return tracked
