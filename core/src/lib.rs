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
mod ops;
mod partition;
mod runs;
mod tracker;

use std::collections::{HashMap as StdHashMap, HashSet as StdHashSet};

use pyo3::exceptions::PyValueError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use partition::{Admission, PartitionCore as Core, QueueKey};

/// What `release_ready` returns: records, tokens, attempts (parallel lists), payload bytes, and
/// the positions of the suspects among them (rare: after a crash).
type Released<'py> = (Bound<'py, PyList>, Bound<'py, PyList>, Bound<'py, PyList>, i64, Vec<usize>);

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
                        start_offset = None, cascades = None))]
    fn new(
        ordered: bool,
        settled_before: Option<StdHashSet<i64>>,
        attempts_before: Option<StdHashMap<i64, u32>>,
        suspects: bool,
        start_offset: Option<i64>,
        cascades: Option<StdHashSet<i64>>,
    ) -> Self {
        PartitionCore {
            core: Core::new(
                ordered,
                settled_before.unwrap_or_default().into_iter().collect(),
                attempts_before.unwrap_or_default().into_iter().collect(),
                suspects,
                start_offset,
                cascades.unwrap_or_default().into_iter().collect(),
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
    #[pyo3(signature = (now, budget, per_key, byte_budget, lease_ms = None, *, pooled = false))]
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
    ) -> PyResult<Released<'py>> {
        let mut items = Vec::new();
        let mut tokens = Vec::new();
        let mut attempts = Vec::new();
        let mut suspects = Vec::new();
        let written = Admission { lease_ms, pooled };
        let totals = self.core.release_ready(now, budget, per_key, byte_budget, written, |entry, token| {
            if entry.suspect {
                suspects.push(items.len());
            }
            items.push(entry.item.clone_ref(py));
            tokens.push(token);
            attempts.push(entry.attempts);
        });
        let (items, tokens, attempts) = (PyList::new(py, items)?, PyList::new(py, tokens)?, PyList::new(py, attempts)?);
        Ok((items, tokens, attempts, totals.bytes, suspects))
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
    fn take_ops(&mut self) -> String {
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

#[pymodule]
#[pyo3(name = "_core")]
fn ordering_layer_core(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<fetch::NativeFetch>()?;
    module.add_class::<PartitionCore>()?;
    module.add_function(wrap_pyfunction!(partition_runs, module)?)?;
    module.add_function(wrap_pyfunction!(kafka_partition_runs, module)?)?;
    module.add_function(wrap_pyfunction!(command_runs, module)?)?;
    Ok(())
}
