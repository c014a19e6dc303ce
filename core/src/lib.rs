//! ordering_layer._core: the subscriber's per-partition dispatch bookkeeping, compiled.
//!
//! The engine runs on it; `ordering_layer/subscriber/partition.py` is its reference, whose
//! semantics it keeps (see `partition.rs`). Python crosses into it once per batch: a fetched batch
//! in, a release of up to a budget of ready keys out as parallel lists, a batch of acks in with the
//! new commit point out. Records stay Python objects: the core keeps a reference to each and hands
//! it back on release, reading only `offset`, `key` and `size`; which of them are suspects (ACK-6,
//! DLQ-3) it says with the release. The ops for Redis (packed, see `ops.rs` and `runs.rs`) are written
//! as the decisions are made. Assignment generations, epochs, leases, start notes and dead-letter
//! policy stay in Python.

mod fetch;
mod key_queue;
mod leases;
mod ops;
mod partition;
mod runs;
mod tracker;

use std::collections::{HashMap as StdHashMap, HashSet as StdHashSet};

use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use leases::{LeaseSettings, Leases};
use partition::{Admission, PartitionCore as Core, QueueKey};

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
    /// `items[start:stop]` into the core; `read` gives an item's offset, payload size and key.
    fn take<'py>(
        &mut self,
        items: &Bound<'py, PyList>,
        start: usize,
        stop: Option<usize>,
        read: impl Fn(&Bound<'py, PyAny>) -> PyResult<(i64, i64, Bound<'py, PyAny>)>,
    ) -> PyResult<Vec<i64>> {
        let stop = stop.unwrap_or(usize::MAX).min(items.len());
        let mut skipped = Vec::new();
        for index in start..stop {
            let item = items.get_item(index)?;
            let (offset, size, key) = read(&item)?;
            if !self.core.add(offset, key_bytes(&key)?, size, item.unbind()) {
                skipped.push(offset);
            }
        }
        Ok(skipped)
    }
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

    /// Take fetched records `records[start:stop]` (objects with `offset`, `key`, `size`); returns
    /// the offsets skipped (duplicates, or settled before a crash).
    #[pyo3(signature = (records, start = 0, stop = None))]
    fn add(&mut self, records: &Bound<'_, PyList>, start: usize, stop: Option<usize>) -> PyResult<Vec<i64>> {
        let py = records.py();
        self.take(records, start, stop, |record| {
            let offset: i64 = record.getattr(intern!(py, "offset"))?.extract()?;
            let size: i64 = record.getattr(intern!(py, "size"))?.extract()?;
            Ok((offset, size, record.getattr(intern!(py, "key"))?))
        })
    }

    /// Take confluent-kafka `Message`s `messages[start:stop]` as they come from `consume()`: the
    /// core calls `offset()`, `key()` and `value()` itself, so no `Record` is made per message.
    /// Returns the offsets skipped, as `add` does.
    #[pyo3(signature = (messages, start = 0, stop = None))]
    fn add_kafka(&mut self, messages: &Bound<'_, PyList>, start: usize, stop: Option<usize>) -> PyResult<Vec<i64>> {
        let py = messages.py();
        self.take(messages, start, stop, |message| {
            let offset: i64 = message.call_method0(intern!(py, "offset"))?.extract()?;
            let value = message.call_method0(intern!(py, "value"))?;
            let size = if value.is_none() { 0 } else { value.len()? as i64 };
            Ok((offset, size, message.call_method0(intern!(py, "key"))?))
        })
    }

    /// Release from the ready keys, oldest first: up to `per_key` records of each, `budget` in all,
    /// no further key once `byte_budget` bytes are used up; a quarantined suspect goes out alone, one
    /// at a time per partition. Returns (records, tokens, attempts, payload bytes, positions of the
    /// suspects among the records: their starts are to be written before user code runs). The attempts are queued as `DELIVERED` ops (pull mode), or `RELEASED`
    /// when `pooled` (callback mode); with `lease_ms`, as one batch lease and `BATCH_DELIVERED` or
    /// `BATCH_RELEASED` ops.
    #[pyo3(signature = (now, budget, per_key, byte_budget, lease_ms = None, *, pooled = false, leases = None,
                        partition = 0, epoch = 0))]
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
    ) -> PyResult<Released<'py>> {
        let mut items = Vec::new();
        let mut tokens = Vec::new();
        let mut attempts = Vec::new();
        let mut suspects = Vec::new();
        let mut handles = Vec::new();
        let mut table = leases.map(Bound::borrow_mut);
        let batch = table.as_mut().map(|table| table.leases.begin_batch(now));
        // With a lease table the lease is not written with the release: the table writes it if the
        // delivery is still outstanding when it is due (`LeaseTable.write_leases`).
        let wall_ms = lease_ms.unwrap_or(0);
        let written = Admission { lease_ms: if table.is_some() { None } else { lease_ms }, pooled };
        let totals = self.core.release_ready(now, budget, per_key, byte_budget, written, |entry, token| {
            if entry.suspect {
                suspects.push(items.len());
            }
            if let (Some(table), Some(batch)) = (table.as_mut(), batch) {
                handles.push(table.leases.admit(batch, partition, epoch, entry.offset, token, entry.size, now, wall_ms));
            }
            items.push(entry.item.clone_ref(py));
            tokens.push(token);
            attempts.push(entry.attempts);
        });
        if let (Some(table), Some(batch)) = (table.as_mut(), batch) {
            table.leases.end_batch(batch);
        }
        let (items, tokens, attempts) = (PyList::new(py, items)?, PyList::new(py, tokens)?, PyList::new(py, attempts)?);
        Ok((items, tokens, attempts, totals.bytes, suspects, handles))
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
        self.core.ops.push(kind, offset, value);
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
/// objects with a `partition`; a batch from `consume` comes in runs of one partition).
#[pyfunction]
fn partition_runs(records: &Bound<'_, PyList>) -> PyResult<Vec<(i64, usize, usize)>> {
    let py = records.py();
    runs_of(records, |record| record.getattr(intern!(py, "partition"))?.extract())
}

/// `partition_runs` for confluent-kafka `Message`s (`partition()` is a method there).
#[pyfunction]
fn kafka_partition_runs(messages: &Bound<'_, PyList>) -> PyResult<Vec<(i64, usize, usize)>> {
    let py = messages.py();
    runs_of(messages, |message| message.call_method0(intern!(py, "partition"))?.extract())
}

/// The Redis command runs of packed state ops, as `apply.lua` takes them (see `runs.rs`): the header
/// (`"<key>,<COMMAND>;"` per run) and each run's arguments as a MessagePack array of strings.
#[pyfunction]
fn command_runs(py: Python<'_>, packed: &str) -> PyResult<(String, Vec<Py<PyBytes>>)> {
    let runs = py.detach(|| runs::group(packed)).map_err(|error| PyValueError::new_err(error.to_string()))?;
    let arguments = runs.arguments.iter().map(|encoded| PyBytes::new(py, encoded).unbind()).collect();
    Ok((runs.header, arguments))
}

/// Take the objects of `items` out of the cyclic garbage collector's sight (`Message`s as they are
/// handed out). A message refers to its record (untracked too), ints, bytes, its topic and its
/// engine inbox's bound `put`; the only cycle it can be part of runs through that inbox while it
/// waits there as an ack, and the engine drains its inbox, so reference counting alone frees it.
/// Thousands of messages are outstanding at a time: tracked, each young collection walked them
/// (`bench/RESULTS.md`).
#[pyfunction]
fn untrack_all(items: &Bound<'_, PyList>) {
    for item in items.iter() {
        // SAFETY: the object is alive (the list holds it); untracking an untracked object or one
        // of a type the collector does not track changes nothing.
        unsafe {
            let flags = pyo3::ffi::PyType_GetFlags(pyo3::ffi::Py_TYPE(item.as_ptr()));
            if flags & pyo3::ffi::Py_TPFLAGS_HAVE_GC != 0 {
                pyo3::ffi::PyObject_GC_UnTrack(item.as_ptr().cast());
            }
        }
    }
}

/// Outstanding deliveries and their leases (`leases.rs`), for the engine's coordinator: deliveries
/// are named by handles; a run of plain acks is settled here and in the partitions' cores in one call.
#[pyclass(module = "ordering_layer._core", name = "LeaseTable")]
struct LeaseTable {
    leases: Leases,
}

/// A delivery's lease handle (its `lease` attribute).
fn handle_of(item: &Bound<'_, PyAny>) -> PyResult<u64> {
    item.getattr(intern!(item.py(), "lease"))?.extract()
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
        let mut settled = 0;
        let mut cache = OwnedCache { owned: owned.clone(), current: None };
        for message in messages.iter() {
            let handle = handle_of(&message)?;
            let Some(&lease) = self.leases.get(handle) else { continue };
            let Some(core) = cache.core(lease.partition, lease.epoch)? else { continue };
            core.borrow_mut().core.ack_leased(lease.offset, lease.token, lease.written);
            self.leases.pop(handle, Some(now));
            settled += 1;
        }
        Ok(settled)
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
            let attempt: i64 = note.getattr(intern!(note.py(), "attempt"))?.extract()?;
            core.borrow_mut().core.ops.push(kind, lease.offset, attempt);
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
    module.add_class::<PartitionCore>()?;
    module.add_class::<LeaseTable>()?;
    module.add_function(wrap_pyfunction!(partition_runs, module)?)?;
    module.add_function(wrap_pyfunction!(kafka_partition_runs, module)?)?;
    module.add_function(wrap_pyfunction!(command_runs, module)?)?;
    module.add_function(wrap_pyfunction!(untrack_all, module)?)?;
    Ok(())
}
