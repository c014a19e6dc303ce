//! ordering_layer._core: the subscriber's per-partition dispatch bookkeeping, compiled.
//!
//! The engine runs on it; `ordering_layer/subscriber/partition.py` is its reference, whose
//! semantics it keeps (see `partition.rs`). Python crosses into it once per batch: a fetched batch
//! in, a release of up to a budget of ready keys out (as the `Message`s handed to user code,
//! `release_messages`, or as parallel lists), a batch of acks in with the new commit point out.
//! Records are Python objects, compiled `Record`s (`record.rs`) when fetched: the core keeps a
//! reference to each and hands it back on release, reading only `offset`, `key` and `size` (a
//! `Record`'s fields directly, anything else's as attributes), and marks the suspects among them
//! (ACK-6, DLQ-3). The ops for Redis (packed, see `ops.rs`; grouped into command
//! runs and encoded for the socket, `runs.rs`) are written as the decisions are made. Assignment
//! generations, epochs, start notes and dead-letter policy stay in Python; leases are the
//! `LeaseTable`'s (`leases.rs`).

mod delivery;
mod fetch;
mod key_queue;
mod leases;
mod moves;
mod ops;
mod partition;
mod record;
mod runs;
mod tracker;

use std::collections::{HashMap as StdHashMap, HashSet as StdHashSet};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::{PyTraverseError, PyVisit};
use pyo3::types::{PyBytes, PyDict, PyList, PyType};

use leases::{LeaseSettings, Leases};
use partition::{Admission, PartitionCore as Core, PerKey, QueueKey};
use delivery::{handle_of, AckQueue, Delivery, Fields, Maker};
use record::Record;

/// What `release_ready` returns: records, tokens, attempts (parallel lists), payload bytes, the
/// positions of the suspects among them (rare: after a crash), and the deliveries' lease handles
/// (when a `LeaseTable` took them as outstanding; else empty).
type Released<'py> = (Bound<'py, PyList>, Bound<'py, PyList>, Bound<'py, PyList>, i64, Vec<usize>, Vec<u64>);

/// Dispatch state of one owned partition (see the module's documentation).
#[pyclass(module = "ordering_layer._core", name = "PartitionCore")]
struct PartitionCore {
    core: Core<Py<PyAny>>,
}

impl PartitionCore {
    /// Release within `limits` (see `release_ready`), as Rust lists.
    fn release(&mut self, py: Python<'_>, limits: &Limits, leases: Option<&Bound<'_, LeaseTable>>, partition: i32,
               epoch: i64) -> ReleaseOut {
        let mut out = ReleaseOut::default();
        let mut table = leases.map(Bound::borrow_mut);
        let batch = table.as_mut().map(|table| table.leases.begin_batch(limits.now));
        // With a lease table the lease is not written with the release: the table writes it if the
        // delivery is still outstanding when it is due (`LeaseTable.write_leases`).
        let wall_ms = limits.lease_ms.unwrap_or(0);
        let written = Admission { lease_ms: if table.is_some() { None } else { limits.lease_ms }, pooled: limits.pooled };
        let now = limits.now;
        let totals = self.core.release_ready(now, limits.budget, limits.per_key, limits.byte_budget, written,
                                             |entry, token| {
            if entry.suspect {
                out.suspects.push(out.items.len());
            }
            if let (Some(table), Some(batch)) = (table.as_mut(), batch) {
                out.handles.push(table.leases.admit(batch, partition, epoch, entry.offset, token, entry.size, now,
                                                    wall_ms));
            }
            out.items.push(entry.item.clone_ref(py));
            out.tokens.push(token);
            out.attempts.push(entry.attempts);
        });
        if let (Some(table), Some(batch)) = (table.as_mut(), batch) {
            table.leases.end_batch(batch);
        }
        out.bytes = totals.bytes;
        out
    }
}

/// The limits of one release (`release_ready`'s arguments).
struct Limits {
    now: f64,
    budget: i64,
    per_key: PerKey,
    byte_budget: i64,
    lease_ms: Option<i64>,
    pooled: bool,
}

/// One release: records, tokens and attempts (parallel), the suspects' positions, the lease handles
/// (empty without a lease table), the payload bytes.
#[derive(Default)]
struct ReleaseOut {
    items: Vec<Py<PyAny>>,
    tokens: Vec<u64>,
    attempts: Vec<u32>,
    suspects: Vec<usize>,
    handles: Vec<u64>,
    bytes: i64,
}

const METADATA_PARTITION_COUNT: usize = 1; // `RecordMetadata.partition_count`

/// How one partition's released records become `Message`s: the `Message` class (a subclass of
/// `Delivery`, `delivery.rs`) of the released `Record`s (`record.rs`), the topic, where
/// requests are posted (the engine's inbox), where first plain acks go (the engine's `AckQueue`), and
/// whether keys order (otherwise each message queues alone, under its offset).
#[pyclass(module = "ordering_layer._core", name = "Deliveries", frozen)]
struct Deliveries {
    messages: Maker,
    topic: Py<PyAny>,
    submit: Py<PyAny>,
    acks: Option<Py<AckQueue>>,
    ordered: bool,
}

#[pymethods]
impl Deliveries {
    #[new]
    #[pyo3(signature = (messages, topic, submit, ordered, acks = None))]
    fn new(messages: &Bound<'_, PyType>, topic: Py<PyAny>, submit: Py<PyAny>, ordered: bool,
           acks: Option<Py<AckQueue>>) -> PyResult<Self> {
        Ok(Deliveries { messages: Maker::new(messages)?, topic, submit, acks, ordered })
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        self.messages.traverse(&visit)?;
        visit.call(&self.topic)?;
        visit.call(&self.submit)?;
        if let Some(acks) = &self.acks {
            visit.call(acks)?;
        }
        Ok(())
    }
}

impl Deliveries {
    /// The messages of one release (see `release_messages`), and its payload bytes.
    fn make<'py>(&self, py: Python<'py>, out: ReleaseOut, epoch: i64) -> PyResult<(Bound<'py, PyList>, i64)> {
        let mut suspects = out.suspects.iter().peekable();
        let messages = PyList::empty(py);
        for (position, item) in out.items.into_iter().enumerate() {
            let record = item.into_bound(py);
            let fields = record.cast::<Record>().map_err(|_| PyTypeError::new_err("a released item is not a Record"))?.get();
            let attempt = out.attempts[position];
            fields.set_attempts(i64::from(attempt));
            if suspects.next_if_eq(&&position).is_some() {
                fields.set_suspect(true);
            }
            let queue_key = match &fields.key {
                Some(key) if self.ordered && !key.as_bytes(py).is_empty() => key.clone_ref(py).into_any(),
                _ => fields.offset.into_pyobject(py)?.into_any().unbind(),
            };
            let lease = out.handles.get(position).copied().unwrap_or(0);
            // Out of the cyclic collector's sight (`Maker::make`): a message refers to its record
            // (untracked too), ints, bytes, its topic, its engine's ack queue and its inbox's bound
            // `put`; the only cycle it can be part of runs through that inbox while it waits there as
            // a request, and the engine drains its inbox, so reference counting alone frees it.
            // Thousands of messages are outstanding at a time: tracked, each young collection walked
            // them (measured: the history of `bench/RESULTS.md`).
            let message = self.messages.make(py, Fields {
                record: record.unbind(),
                queue_key,
                token: out.tokens[position],
                attempt: i64::from(attempt),
                lease,
                topic: self.topic.clone_ref(py),
                epoch,
                submit: self.submit.clone_ref(py),
                acks: self.acks.as_ref().map(|acks| acks.clone_ref(py)),
            })?;
            messages.append(message)?;
        }
        Ok((messages, out.bytes))
    }
}

/// The partition count a record was published under (its `RecordMetadata.partition_count`, 0 when
/// unknown) and its timestamp: where a grown topic's history places it (SUB-8).
fn published(metadata: &Bound<'_, PyAny>, timestamp_ms: i64) -> PyResult<(u32, i64)> {
    let count: Option<u32> = metadata.get_item(METADATA_PARTITION_COUNT)?.extract()?;
    Ok((count.unwrap_or(0), timestamp_ms))
}

fn key_bytes<'a>(key: &'a Bound<'_, PyAny>) -> PyResult<Option<&'a [u8]>> {
    if key.is_none() {
        return Ok(None);
    }
    Ok(Some(key.cast::<PyBytes>()?.as_bytes()))
}

#[pymethods]
impl PartitionCore {
    #[new]
    #[pyo3(signature = (*, ordered, settled_before = None, attempts_before = None, suspects = true,
                        start_offset = None, cascades = None, floor = None))]
    fn new(
        ordered: bool,
        settled_before: Option<StdHashSet<i64>>,
        attempts_before: Option<StdHashMap<i64, u32>>,
        suspects: bool,
        start_offset: Option<i64>,
        cascades: Option<StdHashSet<i64>>,
        floor: Option<i64>,
    ) -> Self {
        PartitionCore {
            core: Core::new(
                ordered,
                settled_before.unwrap_or_default().into_iter().collect(),
                attempts_before.unwrap_or_default().into_iter().collect(),
                suspects,
                start_offset,
                cascades.unwrap_or_default().into_iter().collect(),
                floor,
            ),
        }
    }

    /// Take fetched records `records[start:stop]` (`Record`s, or objects with `offset`, `key`,
    /// `size`, `metadata` and `timestamp_ms`); returns the offsets skipped (duplicates, or settled
    /// before a crash). The partition count a record was published under and its append time are
    /// read only while keys moved in by an expansion are looked for.
    #[pyo3(signature = (records, start = 0, stop = None))]
    fn add(&mut self, records: &Bound<'_, PyList>, start: usize, stop: Option<usize>) -> PyResult<Vec<i64>> {
        let py = records.py();
        let stop = stop.unwrap_or(usize::MAX).min(records.len());
        let moves = self.core.has_moves();
        let mut skipped = Vec::new();
        for index in start..stop {
            let item = records.get_item(index)?;
            let key_object; // the key of an object that is not a `Record`, borrowed below
            let (offset, size, key, publish) = if let Ok(record) = item.cast::<Record>() {
                let fields = record.get();
                let publish = if moves { published(fields.metadata_of(py), fields.timestamp_ms)? } else { (0, 0) };
                (fields.offset, fields.size, fields.key_bytes(py), publish)
            } else {
                let offset: i64 = item.getattr(intern!(py, "offset"))?.extract()?;
                let size: i64 = item.getattr(intern!(py, "size"))?.extract()?;
                key_object = item.getattr(intern!(py, "key"))?;
                let publish = if moves {
                    let timestamp: i64 = item.getattr(intern!(py, "timestamp_ms"))?.extract()?;
                    published(&item.getattr(intern!(py, "metadata"))?, timestamp)?
                } else {
                    (0, 0)
                };
                (offset, size, key_bytes(&key_object)?, publish)
            };
            if !self.core.add_published(offset, key, size, item.clone().unbind(), publish) {
                skipped.push(offset);
            }
        }
        Ok(skipped)
    }

    /// Release from the ready keys, oldest first: up to `per_key` records of each (or, with
    /// `run_share`, that share of the records buffered for a key when more, at most `run_most`),
    /// `budget` in all, no further key once `byte_budget` bytes are used up; a quarantined suspect
    /// goes out alone, one at a time per partition. Returns (records, tokens, attempts, payload
    /// bytes, positions of the suspects among the records: their starts are to be written before
    /// user code runs, lease handles). The attempts are queued as `DELIVERED` ops (pull mode), or
    /// `RELEASED` when `pooled` (callback mode); with `lease_ms`, as one batch lease and
    /// `BATCH_DELIVERED` or `BATCH_RELEASED` ops. With a `LeaseTable` (`leases`) the deliveries are
    /// outstanding there, under `partition` and `epoch`.
    #[pyo3(signature = (now, budget, per_key, byte_budget, lease_ms = None, *, pooled = false, leases = None,
                        partition = 0, epoch = 0, run_share = 0.0, run_most = 0))]
    #[allow(clippy::too_many_arguments)] // the arguments of the Python method, plus `py`
    fn release_ready<'py>(
        &mut self,
        py: Python<'py>,
        now: f64,
        budget: i64,
        per_key: i64,
        byte_budget: i64,
        lease_ms: Option<i64>,
        pooled: bool,
        leases: Option<&Bound<'py, LeaseTable>>,
        partition: i32,
        epoch: i64,
        run_share: f64,
        run_most: i64,
    ) -> PyResult<Released<'py>> {
        let per_key = PerKey { base: per_key, share: run_share, most: run_most };
        let limits = Limits { now, budget, per_key, byte_budget, lease_ms, pooled };
        let out = self.release(py, &limits, leases, partition, epoch);
        let (items, tokens, attempts) =
            (PyList::new(py, out.items)?, PyList::new(py, out.tokens)?, PyList::new(py, out.attempts)?);
        Ok((items, tokens, attempts, out.bytes, out.suspects, out.handles))
    }

    /// `release_ready`, handed out as `deliveries` says: the released records as `Message`s (made
    /// without running `__init__`, see `delivery.rs`; out of the cyclic collector's sight), each
    /// record's `attempts` set to its attempt and `suspect` set when it is one. Returns (messages,
    /// payload bytes).
    #[pyo3(signature = (now, budget, per_key, byte_budget, lease_ms, *, pooled, leases, partition, epoch, deliveries,
                        run_share = 0.0, run_most = 0))]
    #[allow(clippy::too_many_arguments)] // the arguments of the Python method, plus `py`
    fn release_messages<'py>(
        &mut self,
        py: Python<'py>,
        now: f64,
        budget: i64,
        per_key: i64,
        byte_budget: i64,
        lease_ms: Option<i64>,
        pooled: bool,
        leases: Option<&Bound<'py, LeaseTable>>,
        partition: i32,
        epoch: i64,
        deliveries: &Bound<'py, Deliveries>,
        run_share: f64,
        run_most: i64,
    ) -> PyResult<(Bound<'py, PyList>, i64)> {
        let per_key = PerKey { base: per_key, share: run_share, most: run_most };
        let limits = Limits { now, budget, per_key, byte_budget, lease_ms, pooled };
        let out = self.release(py, &limits, leases, partition, epoch);
        deliveries.get().make(py, out, epoch)
    }

    /// Settle deliveries (acks): returns the positions of the refused ones (stale tokens) and the
    /// new commit point.
    fn ack(&mut self, offsets: Vec<i64>, tokens: Vec<u64>) -> PyResult<(Vec<usize>, Option<i64>)> {
        if offsets.len() != tokens.len() {
            return Err(PyValueError::new_err("offsets and tokens differ in length"));
        }
        let refused = offsets
            .iter()
            .zip(&tokens)
            .enumerate()
            .filter(|(_, (&offset, &token))| !self.core.ack(offset, token))
            .map(|(position, _)| position)
            .collect();
        Ok((refused, self.core.watermark()))
    }

    /// Settle one delivery (an ack); False when the token is stale. Its `SETTLED` op is queued.
    fn ack_one(&mut self, offset: i64, token: u64) -> bool {
        self.core.ack(offset, token)
    }

    /// Settle a delivered record without an ack (dead-lettered); `key` is the record's key.
    fn settle_dead_lettered(&mut self, offset: i64, key: &Bound<'_, PyAny>) -> PyResult<()> {
        self.core.settle_dead_lettered(offset, key_bytes(key)?);
        Ok(())
    }

    /// Give a delivery back (a nack, or its lease `lapsed`) and back its key off by
    /// `backoff(failures)` seconds; its `NACKED` op carries the attempt nacked, 0 for a lapse.
    /// False when the token is stale.
    #[pyo3(signature = (offset, token, now, backoff, *, lapsed = false))]
    fn nack(&mut self, offset: i64, token: u64, now: f64, backoff: &Bound<'_, PyAny>, lapsed: bool) -> PyResult<bool> {
        self.core.nack(offset, token, now, lapsed, |failures| backoff.call1((failures,))?.extract::<f64>())
    }

    /// Give a delivery back because the layer failed (no failure counted), held `delay` seconds;
    /// with `uncount` its attempt is taken back too. False when the token is stale.
    #[pyo3(signature = (offset, token, now, delay, *, uncount = false))]
    fn requeue(&mut self, offset: i64, token: u64, now: f64, delay: f64, uncount: bool) -> bool {
        self.core.requeue(offset, token, now, delay, uncount)
    }

    /// True while the recovery walk holds releases: records up to the highest offset settled before
    /// the claim have not all been taken yet.
    #[getter]
    fn walking(&self) -> bool {
        self.core.walking()
    }

    /// Release during the walk from now on (the fetch is held over a buffer limit).
    fn end_walk(&mut self) {
        self.core.end_walk();
    }

    /// Move keys whose backoff has ended back to the ready set.
    fn wake(&mut self, now: f64) {
        self.core.wake(now);
    }

    /// The earliest end of a backoff, if any key is backing off.
    fn next_wake(&self) -> Option<f64> {
        self.core.next_wake()
    }

    /// Keys with something outstanding or backing off (a scan).
    fn held_keys(&self) -> usize {
        self.core.held_keys()
    }

    /// The ready keys, oldest first: key bytes, or the offset of an unordered record (a scan).
    fn ready_keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        qkey_list(py, self.core.ready_keys())
    }

    /// The keys whose next record is quarantined, waiting for the outstanding one, oldest first (a scan).
    fn waiting_keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        qkey_list(py, self.core.waiting_keys())
    }

    /// The offset of the outstanding quarantined suspect; None when none is out.
    #[getter]
    fn quarantined(&self) -> Option<i64> {
        self.core.quarantined()
    }

    /// Queue an op decided in Python (a lease extension, a commit watermark), in decision order.
    fn push_op(&mut self, kind: char, offset: i64, value: i64) {
        self.core.push_op(kind, offset, value);
    }

    /// Take the topic's partition-count history, `[(count, since_ms), ...]`, for this partition,
    /// `partition` (SUB-8): from now on a record of a key that lived in another partition under an
    /// earlier count holds its key until `clear_moved`. Keys cleared before are held again.
    fn set_moves(&mut self, partition: u32, counts: Vec<(u32, i64)>) {
        self.core.set_moves(partition, counts);
    }

    /// Take the marks of keys that moved away, `[(key, count, below), ...]` (SUB-8): their records
    /// here below offset `below`, published under a count below `count`, are settled and skipped.
    fn set_departed(&mut self, marks: Vec<(Vec<u8>, u32, i64)>) {
        self.core.set_departed(marks.into_iter().map(|(key, count, below)| (key.as_slice().into(), count, below)).collect());
    }

    /// Keys held for a move since the last call: `[(key, count published under), ...]`.
    fn take_moved<'py>(&mut self, py: Python<'py>) -> Vec<(Bound<'py, PyBytes>, u32)> {
        self.core.take_moved().into_iter().map(|(key, count)| (PyBytes::new(py, &key), count)).collect()
    }

    /// Release `key`, held for a move: its records in its old partitions are settled.
    fn clear_moved(&mut self, key: &[u8]) {
        self.core.clear_moved(key);
    }

    /// Keys held for a move now.
    #[getter]
    fn moved_holding(&self) -> usize {
        self.core.moved_holding()
    }

    /// The queued ops packed for `apply.lua` (`"<letter>,<offset>,<value>;"` each); empties the queue.
    /// With `floor` (a flush takes them) the commit point follows as a `FLOOR` op when it rose.
    #[pyo3(signature = (*, floor = false))]
    fn take_ops(&mut self, floor: bool) -> String {
        if floor {
            self.core.queue_floor();
        }
        self.core.ops.take()
    }

    /// Ops queued since the last `take_ops`.
    #[getter]
    fn ops_count(&self) -> usize {
        self.core.ops.count
    }

    /// Fetched records not yet released.
    #[getter]
    fn buffered(&self) -> i64 {
        self.core.buffered
    }

    /// Ready keys, at most (`ready_len`: keys left the ready set since are counted until a release
    /// passes them); 0 while the recovery walk holds releases.
    #[getter]
    fn ready(&self) -> usize {
        self.core.ready_len()
    }

    /// Keys with a delivery outstanding.
    #[getter]
    fn busy(&self) -> usize {
        self.core.busy
    }

    /// The offset to commit (the lowest fetched offset not settled); None before any fetch.
    #[getter]
    fn watermark(&self) -> Option<i64> {
        self.core.watermark()
    }

    /// One past the last fetched offset; None before any fetch.
    #[getter]
    fn next_offset(&self) -> Option<i64> {
        self.core.next_offset()
    }
}

/// Queue keys as Python sees them: key bytes, or the offset of an unordered record.
fn qkey_list<'py>(py: Python<'py>, qkeys: Vec<&QueueKey>) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for qkey in qkeys {
        match qkey {
            QueueKey::Key(key) => list.append(PyBytes::new(py, key))?,
            QueueKey::Offset(offset) => list.append(offset)?,
        }
    }
    Ok(list)
}

/// One flush's `apply.lua` calls, encoded as Redis protocol commands ready for the socket: for each
/// (keys, epoch, packed ops), `EVALSHA sha <number of keys> <keys> <epoch> <header> <runs>` with the
/// ops' command runs as `command_runs` makes them. ValueError for malformed ops (nothing encoded).
#[pyfunction]
fn evalsha_commands(py: Python<'_>, sha: &str, calls: Vec<(Vec<String>, i64, String)>) -> PyResult<Py<PyBytes>> {
    // Encoded without the GIL: the callback workers run meanwhile, on the other core (measured: a
    // flush encoded with the GIL held ran the subscriber 5 % slower).
    let encoded = py.detach(|| encode_calls(sha, &calls)).map_err(|error| PyValueError::new_err(error.to_string()))?;
    Ok(PyBytes::new(py, &encoded).unbind())
}

/// `evalsha_commands`'s encoding.
fn encode_calls(sha: &str, calls: &[(Vec<String>, i64, String)]) -> Result<Vec<u8>, runs::OpsError> {
    let mut out = Vec::new();
    for (keys, epoch, packed) in calls {
        let runs = runs::group(packed)?;
        let epoch = epoch.to_string();
        let count = 3 + keys.len() + 2 + runs.arguments.len();
        resp_array(&mut out, count);
        let number_of_keys = keys.len().to_string();
        for argument in ["EVALSHA", sha, &number_of_keys] {
            resp_bulk(&mut out, argument.as_bytes());
        }
        for key in keys {
            resp_bulk(&mut out, key.as_bytes());
        }
        resp_bulk(&mut out, epoch.as_bytes());
        resp_bulk(&mut out, runs.header.as_bytes());
        for argument in &runs.arguments {
            resp_bulk(&mut out, argument);
        }
    }
    Ok(out)
}

/// A Redis protocol array header.
fn resp_array(out: &mut Vec<u8>, count: usize) {
    out.push(b'*');
    out.extend_from_slice(count.to_string().as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// A Redis protocol bulk string.
fn resp_bulk(out: &mut Vec<u8>, bytes: &[u8]) {
    out.push(b'$');
    out.extend_from_slice(bytes.len().to_string().as_bytes());
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
}

/// Runs of one partition in a batch: (partition, start, stop) each, in order; `partition_of` reads
/// an item's partition.
fn runs_of(
    items: &Bound<'_, PyList>,
    partition_of: impl Fn(&Bound<'_, PyAny>) -> PyResult<i64>,
) -> PyResult<Vec<(i64, usize, usize)>> {
    let mut runs: Vec<(i64, usize, usize)> = Vec::new();
    for (index, item) in items.iter().enumerate() {
        let partition = partition_of(&item)?;
        match runs.last_mut() {
            Some(run) if run.0 == partition => run.2 = index + 1,
            _ => runs.push((partition, index, index + 1)),
        }
    }
    Ok(runs)
}

/// Runs of one partition in a fetched batch: (partition, start, stop) each, in order (records are
/// `Record`s or objects with a `partition`; a batch from `consume` comes in runs of one partition).
#[pyfunction]
fn partition_runs(records: &Bound<'_, PyList>) -> PyResult<Vec<(i64, usize, usize)>> {
    let py = records.py();
    runs_of(records, |record| match record.cast::<Record>() {
        Ok(record) => Ok(i64::from(record.get().partition)),
        Err(_) => record.getattr(intern!(py, "partition"))?.extract(),
    })
}

/// The Redis command runs of packed state ops, as `apply.lua` takes them (see `runs.rs`): the header
/// (`"<key>,<COMMAND>;"` per run) and each run's arguments as a MessagePack array of strings.
#[pyfunction]
fn command_runs(py: Python<'_>, packed: &str) -> PyResult<(String, Vec<Py<PyBytes>>)> {
    let runs = py.detach(|| runs::group(packed)).map_err(|error| PyValueError::new_err(error.to_string()))?;
    let arguments = runs.arguments.iter().map(|encoded| PyBytes::new(py, encoded).unbind()).collect();
    Ok((runs.header, arguments))
}

/// Outstanding deliveries and their leases (`leases.rs`), for the engine's coordinator: deliveries
/// are named by handles; a run of plain acks is settled here and in the partitions' cores in one call.
#[pyclass(module = "ordering_layer._core", name = "LeaseTable")]
struct LeaseTable {
    leases: Leases,
}

/// The whole per-key batches at the head of `ready` that fit in `room` messages, for a pull
/// (`PullWaiters.serve`). A batch is a run of consecutive messages of one queue key and partition; a
/// message at a batch's head whose lease `holds` no longer names (a `LeaseTable`, or any callable of
/// a handle) is passed over. Returns the messages taken, in order, and how many of `ready`'s first
/// items were looked at (taken or passed over): the scan stops at the first batch larger than the
/// room left.
#[pyfunction]
fn whole_batches<'py>(ready: &Bound<'py, PyList>, room: usize, holds: &Bound<'py, PyAny>)
                      -> PyResult<(Bound<'py, PyList>, usize)> {
    let table = holds.cast::<LeaseTable>().ok();
    let held = |item: &Bound<'py, PyAny>| -> PyResult<bool> {
        let handle = handle_of(item)?;
        match table {
            Some(table) => Ok(table.borrow().leases.get(handle).is_some()),
            None => holds.call1((handle,))?.is_truthy(),
        }
    };
    let count = ready.len();
    let (mut at, mut room) = (0, room);
    let mut spans: Vec<(usize, usize)> = Vec::new(); // taken: [start, end) of ready, merged when adjacent
    let read = |index: usize| -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>, i64)> {
        let item = ready.get_item(index)?;
        let (key, partition) = (delivery::queue_key_of(&item)?, delivery::partition_of(&item)?);
        Ok((item, key, partition))
    };
    let mut next = None; // item `at`, its key and partition, when the scan before read them
    while at < count {
        let (first, key, partition) = match next.take() {
            Some(read) => read,
            None => read(at)?,
        };
        if !held(&first)? {
            at += 1;
            continue;
        }
        let mut end = at + 1;
        while end < count {
            let (item, other, its_partition) = read(end)?;
            if its_partition != partition || !delivery::same_key(&other, &key)? {
                next = Some((item, other, its_partition));
                break;
            }
            end += 1;
        }
        if end - at > room {
            break;
        }
        room -= end - at;
        match spans.last_mut() {
            Some(last) if last.1 == at => last.1 = end,
            _ => spans.push((at, end)),
        }
        at = end;
    }
    let taken = match spans.as_slice() {
        [] => PyList::empty(ready.py()),
        [(start, end)] => ready.get_slice(*start, *end),
        _ => {
            let taken = PyList::empty(ready.py());
            for &(start, end) in &spans {
                for index in start..end {
                    taken.append(ready.get_item(index)?)?;
                }
            }
            taken
        }
    };
    Ok((taken, at))
}

/// An owned partition's core and owner epoch.
type OwnedState<'py> = (Bound<'py, PartitionCore>, i64);

/// The core and epoch of `partition` among `owned` (partition -> `OwnedPartition`: objects with
/// `core` and `epoch`), if it is owned.
fn owned_core<'py>(owned: &Bound<'py, PyDict>, partition: i32) -> PyResult<Option<OwnedState<'py>>> {
    let Some(state) = owned.get_item(partition)? else { return Ok(None) };
    let py = owned.py();
    let core = state.getattr(intern!(py, "core"))?.cast_into::<PartitionCore>()?;
    Ok(Some((core, state.getattr(intern!(py, "epoch"))?.extract()?)))
}

/// A run's lookups of the owned partitions, one per partition change (runs mostly stay on one).
struct OwnedCache<'py> {
    owned: Bound<'py, PyDict>,
    current: Option<(i32, Option<OwnedState<'py>>)>,
}

impl<'py> OwnedCache<'py> {
    /// The partition's core, when it is owned under `epoch`.
    fn core(&mut self, partition: i32, epoch: i64) -> PyResult<Option<&Bound<'py, PartitionCore>>> {
        if self.current.as_ref().is_none_or(|(cached, _)| *cached != partition) {
            self.current = Some((partition, owned_core(&self.owned, partition)?));
        }
        Ok(match &self.current {
            Some((_, Some((core, owned_epoch)))) if *owned_epoch == epoch => Some(core),
            _ => None,
        })
    }
}

impl LeaseTable {
    /// Settle the deliveries `handles` name (see `ack_run`).
    fn ack_handles(&mut self, handles: &[u64], owned: &Bound<'_, PyDict>, now: f64) -> PyResult<usize> {
        let mut settled = 0;
        let mut cache = OwnedCache { owned: owned.clone(), current: None };
        for &handle in handles {
            let Some(&lease) = self.leases.get(handle) else { continue };
            let Some(core) = cache.core(lease.partition, lease.epoch)? else { continue };
            core.borrow_mut().core.ack_leased(lease.offset, lease.token, lease.written);
            self.leases.pop(handle, Some(now));
            settled += 1;
        }
        Ok(settled)
    }
}

#[pymethods]
impl LeaseTable {
    #[new]
    #[pyo3(signature = (*, ack_deadline, max_lease_duration, min_extension = 0.0, max_extension = 0.0, track = true))]
    fn new(ack_deadline: f64, max_lease_duration: f64, min_extension: f64, max_extension: f64, track: bool) -> Self {
        LeaseTable {
            leases: Leases::new(LeaseSettings { ack_deadline, max_lease_duration, min_extension, max_extension, track }),
        }
    }

    /// Deliveries outstanding.
    #[getter]
    fn count(&self) -> usize {
        self.leases.count()
    }

    /// Their payload bytes.
    #[getter]
    fn bytes(&self) -> i64 {
        self.leases.bytes
    }

    #[getter]
    fn track(&self) -> bool {
        self.leases.settings.track
    }

    #[getter]
    fn extensions(&self) -> u64 {
        self.leases.extensions
    }

    #[getter]
    fn lapses(&self) -> u64 {
        self.leases.lapses
    }

    /// Take released deliveries of `partition` as outstanding, watched together (what
    /// `PartitionCore.release_ready` does itself when handed the table); `lease_ms`, their lease to
    /// write if they are still outstanding when it is due (`write_leases`). Returns their handles.
    #[allow(clippy::too_many_arguments)] // the arguments of the Python method
    #[pyo3(signature = (partition, epoch, offsets, tokens, sizes, now, lease_ms = None))]
    fn admit(&mut self, partition: i32, epoch: i64, offsets: Vec<i64>, tokens: Vec<u64>, sizes: Vec<i64>, now: f64,
             lease_ms: Option<i64>) -> PyResult<Vec<u64>> {
        if offsets.len() != tokens.len() || offsets.len() != sizes.len() {
            return Err(PyValueError::new_err("offsets, tokens and sizes differ in length"));
        }
        let batch = self.leases.begin_batch(now);
        let handles = offsets.iter().zip(&tokens).zip(&sizes)
            .map(|((&offset, &token), &size)| {
                self.leases.admit(batch, partition, epoch, offset, token, size, now, lease_ms.unwrap_or(0))
            })
            .collect();
        self.leases.end_batch(batch);
        Ok(handles)
    }

    /// The delivery a handle names is outstanding.
    fn holds(&self, handle: u64) -> bool {
        self.leases.get(handle).is_some()
    }

    /// (partition, epoch, offset, token) of the delivery a handle names, while outstanding.
    fn lease_of(&self, handle: u64) -> Option<(i32, i64, i64, u64)> {
        self.leases.get(handle).map(|lease| (lease.partition, lease.epoch, lease.offset, lease.token))
    }

    /// The handle of the delivery of `partition:offset` outstanding now.
    fn find(&self, partition: i32, offset: i64) -> Option<u64> {
        self.leases.find(partition, offset)
    }

    /// The deadline of the delivery a handle names (monotonic seconds), while outstanding.
    fn deadline_of(&self, handle: u64) -> Option<f64> {
        self.leases.get(handle).map(|lease| lease.deadline)
    }

    /// Forget a delivery (settled, given back); `acked_at` (now) feeds its ack latency to the p99
    /// extension. False when the handle names nothing.
    #[pyo3(signature = (handle, acked_at = None))]
    fn pop(&mut self, handle: u64, acked_at: Option<f64>) -> bool {
        self.leases.pop(handle, acked_at).is_some()
    }

    /// Settle a run of plain acks (`Message.ack`: deliveries with `lease`), in order: each delivery
    /// still outstanding, whose partition is owned under the epoch it went out with (`owned`:
    /// partition -> `OwnedPartition`), is forgotten here and settled in the partition's core, which
    /// queues its SETTLED op. Returns how many were settled; an ack of a delivery given back or
    /// dropped since, or made under an older epoch, changes nothing (ACK-5).
    fn ack_run(&mut self, messages: &Bound<'_, PyList>, owned: &Bound<'_, PyDict>, now: f64) -> PyResult<usize> {
        let handles = messages.iter().map(|message| handle_of(&message)).collect::<PyResult<Vec<u64>>>()?;
        self.ack_handles(&handles, owned, now)
    }

    /// Settle the plain acks waiting in `queue` (their lease handles, in order), as `ack_run`.
    fn ack_queued(&mut self, queue: &Bound<'_, AckQueue>, owned: &Bound<'_, PyDict>, now: f64) -> PyResult<usize> {
        let handles = queue.get().drain();
        self.ack_handles(&handles, owned, now)
    }

    /// Queue the STARTED op (`kind`) of each noted start (deliveries: `lease` and `attempt`) whose
    /// delivery is still outstanding under its partition's epoch, in the partition's core, after
    /// the ops queued so far. Returns how many were queued.
    fn write_starts(&mut self, notes: &Bound<'_, PyList>, owned: &Bound<'_, PyDict>, kind: char) -> PyResult<usize> {
        let mut queued = 0;
        let mut cache = OwnedCache { owned: owned.clone(), current: None };
        for note in notes.iter() {
            let Some(&lease) = self.leases.get(handle_of(&note)?) else { continue };
            let Some(core) = cache.core(lease.partition, lease.epoch)? else { continue };
            core.borrow_mut().core.push_op(kind, lease.offset, delivery::attempt_of(&note)?);
            queued += 1;
        }
        Ok(queued)
    }

    /// A flush begins: queue the `LEASE` op of each delivery admitted at `before` or earlier, with a
    /// lease to write, that is still outstanding under its partition's epoch and whose lease was not
    /// written yet (ACK-4), in the partition's core. Returns how many ops were queued.
    fn write_leases(&mut self, owned: &Bound<'_, PyDict>, before: f64) -> PyResult<usize> {
        let mut queued = 0;
        let mut cache = OwnedCache { owned: owned.clone(), current: None };
        for lease in self.leases.due_lease_writes(before) {
            let Some(core) = cache.core(lease.partition, lease.epoch)? else { continue };
            core.borrow_mut().core.ops.push(ops::LEASE, lease.offset, lease.wall_ms);
            queued += 1;
        }
        Ok(queued)
    }

    /// When the oldest outstanding delivery whose lease is not written yet was admitted.
    fn next_lease_write(&mut self) -> Option<f64> {
        self.leases.next_lease_write()
    }

    /// `modify_ack_deadline` (ACK-3): the delivery's deadline is `seconds` from now, watched alone;
    /// returns it in epoch ms, None when the handle names nothing.
    fn set_deadline(&mut self, handle: u64, seconds: f64, now: f64) -> Option<i64> {
        self.leases.set_deadline(handle, seconds, now)
    }

    /// A partition let go: its deliveries can no longer be acked here.
    fn drop_partition(&mut self, partition: i32) {
        self.leases.drop_partition(partition);
    }

    /// Outstanding deliveries of these partitions.
    fn count_in(&self, partitions: Vec<i32>) -> usize {
        self.leases.count_in(&partitions)
    }

    /// When `expire` has something to look at next.
    fn next_check(&self) -> Option<f64> {
        self.leases.next_check()
    }

    /// Extend the leases about to end (ACK-2), take out those that lapsed (ACK-1): the extensions
    /// as (partition, offset, epoch ms) and the lapsed as (partition, offset, token), forgotten here.
    #[allow(clippy::type_complexity)] // two lists of plain tuples, as Python takes them
    fn expire(&mut self, now: f64) -> (Vec<(i32, i64, i64)>, Vec<(i32, i64, u64)>) {
        let (extended, lapsed) = self.leases.expire(now);
        (
            extended.iter().map(|extension| (extension.partition, extension.offset, extension.wall_ms)).collect(),
            lapsed.iter().map(|lease| (lease.partition, lease.offset, lease.token)).collect(),
        )
    }

    /// The ack latencies observed since the last call (seconds; at most the last 100,000).
    fn take_latencies(&mut self) -> Vec<f64> {
        self.leases.latencies.drain(..).collect()
    }

    /// The smallest whole second with at least `percent` % of the ack latencies at or below it.
    fn percentile(&self, percent: f64) -> u32 {
        self.leases.percentile(percent)
    }

    /// Per partition: (outstanding deliveries, age of the oldest in seconds).
    fn per_partition(&self, now: f64) -> StdHashMap<i32, (usize, f64)> {
        self.leases.per_partition(now).into_iter().collect()
    }

    /// (slots, batch watches) allocated: what the table keeps however many deliveries it has seen.
    fn allocated(&self) -> (usize, usize) {
        self.leases.allocated()
    }
}

#[pymodule]
#[pyo3(name = "_core")]
fn ordering_layer_core(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<fetch::NativeFetch>()?;
    module.add_class::<fetch::FetchWaker>()?;
    module.add_class::<PartitionCore>()?;
    module.add_class::<LeaseTable>()?;
    module.add_class::<Record>()?;
    let letters = PyDict::new(module.py());
    for (name, letter) in ops::LETTERS {
        letters.set_item(name, letter.to_string())?;
    }
    module.add("OP_LETTERS", letters)?;
    module.add_class::<Deliveries>()?;
    module.add_class::<Delivery>()?;
    module.add_class::<AckQueue>()?;
    module.add_function(wrap_pyfunction!(partition_runs, module)?)?;
    module.add_function(wrap_pyfunction!(command_runs, module)?)?;
    module.add_function(wrap_pyfunction!(evalsha_commands, module)?)?;
    module.add_function(wrap_pyfunction!(delivery::items_of, module)?)?;
    module.add_function(wrap_pyfunction!(delivery::redeliveries, module)?)?;
    module.add_function(wrap_pyfunction!(whole_batches, module)?)?;
    module.add_function(wrap_pyfunction!(delivery::ack_queued_all, module)?)?;
    module.add_function(wrap_pyfunction!(delivery::unsettled, module)?)?;
    Ok(())
}
