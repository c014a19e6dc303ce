//! `Record`: a fetched Kafka record as the subscriber queues it, compiled.
//!
//! Thousands of records wait in the key queues at a time, and each is made on the fetch thread and
//! read by the core and by the coordinator, under the interpreter lock. A `Record` keeps its numbers
//! as Rust values, not Python `int`s, and its value as the bytes fetched: the Python `bytes` of the
//! value is made when code reads `value` (a no-op callback never does). Its key stays a Python `bytes`
//! (or None), shared with the deliveries that use it as their queue key. The fields the dispatch
//! changes (`attempts`, `last_error`, `suspect`, `quarantined`) are atomics or a short lock never
//! held while Python runs, so any thread may read and set them.
//!
//! A record refers only to bytes, strings, its header pairs and its `RecordMetadata`, none of which
//! refers back to it, so it can never be part of a reference cycle: it has no `__traverse__`, and the
//! native fetch takes the records it makes out of the cyclic collector's sight (reference counting
//! alone frees them).

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// A record's value: none (a null value), the bytes as fetched, or a Python object given to the
/// constructor.
pub enum Payload {
    Null,
    Fetched(Box<[u8]>),
    Object(Py<PyAny>),
}

/// A fetched Kafka record, as fetched, and the layer metadata read from it once.
///
/// `headers` are the record's header pairs (records with the same headers may share one immutable
/// sequence: `Message.headers()` returns a list of its own). `key` is the ordering key as the
/// record's bytes (None when absent: unordered). `suspect`: it was handed out by an earlier owner of
/// the partition and not settled (maybe it crashed that owner), so a callback worker records the
/// start of each of its deliveries in Redis before user code runs. `quarantined`: a suspect charged
/// two attempts or more; it goes out alone (the core's `Quarantine`, `key_queue.rs`).
#[pyclass(module = "ordering_layer._core", name = "Record", frozen)]
pub struct Record {
    #[pyo3(get)]
    pub partition: i32,
    #[pyo3(get)]
    pub offset: i64,
    pub key: Option<Py<PyBytes>>,
    value: Payload,
    headers: Py<PyAny>,
    metadata: Py<PyAny>,
    #[pyo3(get)]
    pub size: i64,
    #[pyo3(get)]
    pub timestamp_ms: i64,
    attempts: AtomicI64,
    last_error: Mutex<Option<Py<PyAny>>>,
    suspect: AtomicBool,
    quarantined: AtomicBool,
}

/// The fields of a fetched record (see `Record::fetched`).
pub struct FetchedFields {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Py<PyBytes>>,
    pub value: Option<Box<[u8]>>,
    pub headers: Py<PyAny>,
    pub metadata: Py<PyAny>,
    pub timestamp_ms: i64,
}

impl Record {
    /// A record as fetched: no attempt yet, not suspect; its size is its value's length.
    pub fn fetched(fields: FetchedFields) -> Record {
        let size = fields.value.as_ref().map_or(0, |value| value.len() as i64);
        Record {
            partition: fields.partition,
            offset: fields.offset,
            key: fields.key,
            value: fields.value.map_or(Payload::Null, Payload::Fetched),
            headers: fields.headers,
            metadata: fields.metadata,
            size,
            timestamp_ms: fields.timestamp_ms,
            attempts: AtomicI64::new(0),
            last_error: Mutex::new(None),
            suspect: AtomicBool::new(false),
            quarantined: AtomicBool::new(false),
        }
    }

    /// The key's bytes (None when the record has no key).
    pub fn key_bytes<'a>(&'a self, py: Python<'_>) -> Option<&'a [u8]> {
        self.key.as_ref().map(|key| key.as_bytes(py))
    }

    /// The record's `RecordMetadata`.
    pub fn metadata_of<'py>(&self, py: Python<'py>) -> &Bound<'py, PyAny> {
        self.metadata.bind(py)
    }
}

#[pymethods]
impl Record {
    #[new]
    #[pyo3(signature = (partition, offset, key, value, headers, metadata, size, timestamp_ms, attempts = 0,
                        last_error = None, suspect = false, quarantined = false))]
    #[allow(clippy::too_many_arguments)] // the fields of the Python constructor
    fn new(py: Python<'_>, partition: i32, offset: i64, key: Option<Py<PyBytes>>, value: Option<Py<PyAny>>,
           headers: Option<Py<PyAny>>, metadata: Py<PyAny>, size: i64, timestamp_ms: i64, attempts: i64,
           last_error: Option<Py<PyAny>>, suspect: bool, quarantined: bool) -> Record {
        Record {
            partition,
            offset,
            key,
            value: value.map_or(Payload::Null, Payload::Object),
            headers: headers.unwrap_or_else(|| py.None()),
            metadata,
            size,
            timestamp_ms,
            attempts: AtomicI64::new(attempts),
            last_error: Mutex::new(last_error),
            suspect: AtomicBool::new(suspect),
            quarantined: AtomicBool::new(quarantined),
        }
    }

    /// The ordering key as the record's bytes (None when absent).
    #[getter]
    fn key(&self, py: Python<'_>) -> Option<Py<PyBytes>> {
        self.key.as_ref().map(|key| key.clone_ref(py))
    }

    /// The record value (None for a null value); the bytes of a fetched value are made on each read.
    #[getter]
    fn value(&self, py: Python<'_>) -> Py<PyAny> {
        match &self.value {
            Payload::Null => py.None(),
            Payload::Fetched(bytes) => PyBytes::new(py, bytes).into_any().unbind(),
            Payload::Object(object) => object.clone_ref(py),
        }
    }

    #[getter]
    fn headers(&self, py: Python<'_>) -> Py<PyAny> {
        self.headers.clone_ref(py)
    }

    #[getter]
    fn metadata(&self, py: Python<'_>) -> Py<PyAny> {
        self.metadata.clone_ref(py)
    }

    /// The attempts charged to the record (the attempt it went out with last).
    #[getter]
    fn attempts(&self) -> i64 {
        self.attempts.load(Ordering::Relaxed)
    }

    #[setter]
    pub fn set_attempts(&self, attempts: i64) {
        self.attempts.store(attempts, Ordering::Relaxed);
    }

    /// The error of its last failed delivery, if any (for its dead letter).
    #[getter]
    fn last_error(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        locked(&self.last_error).as_ref().map(|error| error.clone_ref(py))
    }

    #[setter]
    fn set_last_error(&self, error: Option<Py<PyAny>>) {
        // The old value is dropped after the lock is let go: dropping it may run Python code.
        let old = std::mem::replace(&mut *locked(&self.last_error), error);
        drop(old);
    }

    #[getter(suspect)]
    pub fn is_suspect(&self) -> bool {
        self.suspect.load(Ordering::Relaxed)
    }

    #[setter]
    pub fn set_suspect(&self, suspect: bool) {
        self.suspect.store(suspect, Ordering::Relaxed);
    }

    #[getter]
    fn quarantined(&self) -> bool {
        self.quarantined.load(Ordering::Relaxed)
    }

    #[setter]
    fn set_quarantined(&self, quarantined: bool) {
        self.quarantined.store(quarantined, Ordering::Relaxed);
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let key = match &self.key {
            Some(key) => key.bind(py).repr()?.to_string(),
            None => "None".to_owned(),
        };
        Ok(format!("Record(partition={}, offset={}, key={key}, size={}, attempts={})", self.partition, self.offset,
                   self.size, self.attempts()))
    }
}

fn locked<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
