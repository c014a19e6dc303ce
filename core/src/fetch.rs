//! The subscriber's fetch without a Python object per fetched message.
//!
//! confluent-kafka's `Consumer` keeps the group membership, the rebalance callbacks, commits,
//! seeks and pauses; its `consume()` makes a Python `Message` for every record, under the GIL. The
//! fetch here takes the records from librdkafka itself, from the very `rd_kafka_t` the `Consumer`
//! wraps (the library confluent-kafka loaded, found with `dlopen(RTLD_NOLOAD)`): each assigned
//! partition's fetch queue is split off the consumer queue (`rd_kafka_queue_forward` to none, the
//! documented way), so the consumer queue keeps only events, which `Consumer.poll` serves as before.
//! The partitions' queues stay apart, and a batch takes from each in turn: a partition whose fetch
//! started late, or whose records came after a backlog of the others', is not queued behind them,
//! and the caller can take from some partitions only (`caps`: those short of records while the
//! others fill its buffer). A queue that gets records while empty wakes a waiting fetch
//! (`rd_kafka_queue_cb_event_enable`). librdkafka bounds each partition's queue on its own
//! (`queued.min.messages`, `queued.max.messages.kbytes` apply per partition queue). `fetch` waits
//! for and copies a batch without the GIL (keys and headers into one buffer per batch, each value
//! into its own), then makes the compiled `Record`s the engine takes (`record.rs`), with the layer
//! metadata read once per distinct header set (`metadata_of`, a Python function, is called only for
//! header sets not shared).
//! A batch comes from the same librdkafka call as `consume()`'s (`rd_kafka_consume_batch_queue`),
//! so records of an outdated fetch version (after a revoke, an unassign or a seek) are treated as
//! `consume()` treats them; the fetcher's assignment generations guard the rest (SUB-3).

use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use foldhash::HashMap as FastMap;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::{PyTraverseError, PyVisit};
use pyo3::types::{PyBytes, PyList, PyString, PyTuple};

use crate::moves::{murmur2, Moves};
use crate::record::{FetchedFields, Record};

const RTLD_NOW: c_int = 2;
const RTLD_NOLOAD: c_int = 4;
const RD_KAFKA_CONSUMER: c_int = 1;
const BATCH_MAX: usize = 10_000;

extern "C" {
    fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}

/// `rd_kafka_message_t` (rdkafka.h, public and stable).
#[repr(C)]
struct RawMessage {
    err: c_int,
    rkt: *mut c_void,
    partition: i32,
    payload: *const u8,
    len: usize,
    key: *const u8,
    key_len: usize,
    offset: i64,
    private: *mut c_void,
}

type KindFn = unsafe extern "C" fn(*mut c_void) -> c_int;
type NameFn = unsafe extern "C" fn(*mut c_void) -> *const c_char;
type EventFn = unsafe extern "C" fn(*mut c_void, *mut c_void);
type QueueEventFn = unsafe extern "C" fn(*mut c_void, Option<EventFn>, *mut c_void);
type QueuePartitionFn = unsafe extern "C" fn(*mut c_void, *const c_char, i32) -> *mut c_void;
type QueueForwardFn = unsafe extern "C" fn(*mut c_void, *mut c_void);
type QueueDestroyFn = unsafe extern "C" fn(*mut c_void);
type ConsumeBatchFn = unsafe extern "C" fn(*mut c_void, c_int, *mut *mut RawMessage, usize) -> isize;
type MessageDestroyFn = unsafe extern "C" fn(*mut RawMessage);
type TimestampFn = unsafe extern "C" fn(*const RawMessage, *mut c_int) -> i64;
type HeadersFn = unsafe extern "C" fn(*const RawMessage, *mut *mut c_void) -> c_int;
type HeaderCountFn = unsafe extern "C" fn(*const c_void) -> usize;
type HeaderGetFn = unsafe extern "C" fn(*const c_void, usize, *mut *const c_char, *mut *const u8, *mut usize) -> c_int;
type ErrorTextFn = unsafe extern "C" fn(c_int) -> *const c_char;

/// The librdkafka functions this fetch calls, looked up in the loaded library.
struct Api {
    kind: KindFn,
    name: NameFn,
    queue_cb_event_enable: QueueEventFn,
    queue_get_partition: QueuePartitionFn,
    queue_forward: QueueForwardFn,
    queue_destroy: QueueDestroyFn,
    consume_batch_queue: ConsumeBatchFn,
    message_destroy: MessageDestroyFn,
    message_timestamp: TimestampFn,
    message_headers: HeadersFn,
    header_cnt: HeaderCountFn,
    header_get_all: HeaderGetFn,
    err2str: ErrorTextFn,
}

fn symbol(lib: *mut c_void, name: &str) -> PyResult<*mut c_void> {
    let cname = CString::new(name).expect("no NUL in a symbol name");
    // SAFETY: lib is a handle dlopen returned; dlsym only reads the library's symbol table.
    let found = unsafe { dlsym(lib, cname.as_ptr()) };
    if found.is_null() {
        return Err(PyRuntimeError::new_err(format!("librdkafka has no {name}")));
    }
    Ok(found)
}

/// `$name` of `$lib` as a function of type `$ty`.
macro_rules! load {
    ($lib:expr, $name:literal, $ty:ty) => {{
        let found = symbol($lib, $name)?;
        // SAFETY: the symbol is librdkafka's function of that name, whose C signature (rdkafka.h)
        // `$ty` declares.
        unsafe { std::mem::transmute::<*mut c_void, $ty>(found) }
    }};
}

impl Api {
    fn load(path: &str) -> PyResult<Api> {
        let cpath = CString::new(path).map_err(|_| PyRuntimeError::new_err("bad library path"))?;
        // SAFETY: RTLD_NOLOAD only returns a library already loaded (confluent-kafka's), else null.
        let lib = unsafe { dlopen(cpath.as_ptr(), RTLD_NOW | RTLD_NOLOAD) };
        if lib.is_null() {
            return Err(PyRuntimeError::new_err(format!("{path} is not loaded")));
        }
        Ok(Api {
            kind: load!(lib, "rd_kafka_type", KindFn),
            name: load!(lib, "rd_kafka_name", NameFn),
            queue_cb_event_enable: load!(lib, "rd_kafka_queue_cb_event_enable", QueueEventFn),
            queue_get_partition: load!(lib, "rd_kafka_queue_get_partition", QueuePartitionFn),
            queue_forward: load!(lib, "rd_kafka_queue_forward", QueueForwardFn),
            queue_destroy: load!(lib, "rd_kafka_queue_destroy", QueueDestroyFn),
            consume_batch_queue: load!(lib, "rd_kafka_consume_batch_queue", ConsumeBatchFn),
            message_destroy: load!(lib, "rd_kafka_message_destroy", MessageDestroyFn),
            message_timestamp: load!(lib, "rd_kafka_message_timestamp", TimestampFn),
            message_headers: load!(lib, "rd_kafka_message_headers", HeadersFn),
            header_cnt: load!(lib, "rd_kafka_header_cnt", HeaderCountFn),
            header_get_all: load!(lib, "rd_kafka_header_get_all", HeaderGetFn),
            err2str: load!(lib, "rd_kafka_err2str", ErrorTextFn),
        })
    }
}

/// Fetch errors: (partition, offset, librdkafka's text).
type Errors = Vec<(i32, i64, String)>;
/// Where a field's bytes are in a batch's `Arena` (start, end); None for a null field.
type Span = Option<(usize, usize)>;

/// A record copied out of librdkafka (no GIL needed to make it): its key, value and headers are in
/// the batch's arena, the headers packed as `pack_header` packs them.
struct Fetched {
    partition: i32,
    offset: i64,
    key: Span,
    /// The value, copied out of librdkafka's message (the `Record` keeps it as it is).
    value: Option<Box<[u8]>>,
    headers: Span,
    timestamp_ms: i64,
}

/// The bytes of one fetched batch, copied into one buffer: no allocation per record.
#[derive(Default)]
struct Arena {
    bytes: Vec<u8>,
}

impl Arena {
    /// A copy of `len` bytes at `data` (None for a null pointer).
    ///
    /// # Safety
    /// `data` is null or points to `len` readable bytes.
    unsafe fn copy(&mut self, data: *const u8, len: usize) -> Span {
        if data.is_null() {
            return None;
        }
        let start = self.bytes.len();
        self.bytes.extend_from_slice(std::slice::from_raw_parts(data, len));
        Some((start, self.bytes.len()))
    }

    fn get(&self, span: (usize, usize)) -> &[u8] {
        &self.bytes[span.0..span.1]
    }
}

struct Queues {
    /// False once closed: nothing is attached any more.
    open: bool,
    /// The attached partitions' queue handles, by partition.
    partitions: BTreeMap<i32, *mut c_void>,
    /// Where the next batch starts taking: one partition further each batch.
    rotation: usize,
}

/// Wakes a fetch waiting for records: librdkafka calls `queue_event` when an attached partition's
/// queue gets records while empty, and `NativeFetch.wake` calls it for the caller.
#[derive(Default)]
struct Waker {
    generation: AtomicU64,
    lock: Mutex<()>,
    cond: Condvar,
}

impl Waker {
    fn wake(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        let _guard = self.lock.lock().expect("fetch waker lock");
        self.cond.notify_all();
    }

    fn seen(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Wait up to `timeout` for a wake after the one `seen` was read at.
    fn wait(&self, seen: u64, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut guard = self.lock.lock().expect("fetch waker lock");
        while self.seen() == seen {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            guard = self.cond.wait_timeout(guard, left).expect("fetch waker lock").0;
        }
    }
}

/// Wakes a `NativeFetch` waiting for records (`NativeFetch.waker`): a separate object, as the
/// fetch itself is borrowed while it waits.
#[pyclass(module = "ordering_layer._core", name = "FetchWaker", frozen)]
pub struct FetchWaker {
    waker: Arc<Waker>,
}

#[pymethods]
impl FetchWaker {
    /// Wake the fetch (any thread): it looks at the queues again and returns what is there, maybe
    /// nothing.
    fn wake(&self) {
        self.waker.wake();
    }
}

/// librdkafka's queue event callback (`rd_kafka_queue_cb_event_enable`): called on one of its
/// threads with the queue locked, so it only wakes the fetch and calls nothing of librdkafka.
unsafe extern "C" fn queue_event(_rk: *mut c_void, opaque: *mut c_void) {
    // SAFETY: opaque is the `Waker` of the fetch the queue is attached to; the fetch disables the
    // callback (under the queue's lock) before it lets the waker go.
    let waker = unsafe { &*(opaque as *const Waker) };
    waker.wake();
}

/// The fetch of one consumer's partitions (see the module's documentation).
#[pyclass(module = "ordering_layer._core", name = "NativeFetch")]
pub struct NativeFetch {
    api: Api,
    rk: *mut c_void,
    topic: CString,
    queues: Mutex<Queues>,
    waker: Arc<Waker>,
    /// The Python objects it holds; None once closed. The `Consumer` whose handle `rk` is stays
    /// alive until the queues are given back (a consumer destroyed while its partitions are
    /// forwarded here would wait for them forever).
    refs: Option<Refs>,
    plain: FastMap<Vec<u8>, (Py<PyAny>, Py<PyAny>)>,
}

/// The Python objects of a `NativeFetch` (seen by the collector: `metadata_of` refers back to the
/// fetcher that holds the fetch).
struct Refs {
    consumer: Py<PyAny>,
    metadata_of: Py<PyAny>,
    empty: Py<PyAny>,
}

// SAFETY: librdkafka's handles are thread-safe; the queue map is behind a mutex and the rest is
// read-only after construction (the metadata cache is only touched with `&mut self`).
unsafe impl Send for NativeFetch {}
unsafe impl Sync for NativeFetch {}

/// Appends one header to a record's packed headers: the name and the value, each after its length
/// as 4 little-endian bytes (`u32::MAX` for a null value). A record's packed headers are the key of
/// the metadata cache.
fn pack_header(packed: &mut Vec<u8>, name: &[u8], value: Option<&[u8]>) {
    packed.extend_from_slice(&(name.len() as u32).to_le_bytes());
    packed.extend_from_slice(name);
    match value {
        None => packed.extend_from_slice(&u32::MAX.to_le_bytes()),
        Some(value) => {
            packed.extend_from_slice(&(value.len() as u32).to_le_bytes());
            packed.extend_from_slice(value);
        }
    }
}

/// The (name, value) pairs of packed headers (`pack_header`).
fn unpack_headers(mut packed: &[u8]) -> Vec<(&[u8], Option<&[u8]>)> {
    let mut pairs = Vec::new();
    let field = |packed: &mut &[u8]| -> Option<Option<usize>> {
        let (length, rest) = packed.split_first_chunk::<4>()?;
        *packed = rest;
        let length = u32::from_le_bytes(*length);
        Some((length != u32::MAX).then_some(length as usize))
    };
    while let Some(Some(name_length)) = field(&mut packed) {
        let (name, rest) = packed.split_at(name_length.min(packed.len()));
        packed = rest;
        let Some(value_length) = field(&mut packed) else { break };
        let value = value_length.map(|length| {
            let (value, rest) = packed.split_at(length.min(packed.len()));
            packed = rest;
            value
        });
        pairs.push((name, value));
    }
    pairs
}

/// The value of a record's `ol-partition-count` header among its packed headers (`pack_header`),
/// 0 when it has none or it is not a positive integer.
fn partition_count_header(packed: &[u8]) -> u32 {
    unpack_headers(packed).into_iter()
        .find(|(name, _)| *name == b"ol-partition-count")
        .and_then(|(_, value)| std::str::from_utf8(value?).ok()?.trim().parse::<u32>().ok())
        .unwrap_or(0)
}

impl Drop for NativeFetch {
    fn drop(&mut self) {
        self.release();
    }
}

impl NativeFetch {
    /// Gives every queue back to librdkafka (idempotent).
    fn release(&self) {
        let mut queues = self.queues.lock().expect("fetch queues lock");
        queues.open = false;
        for (_, queue) in std::mem::take(&mut queues.partitions) {
            // SAFETY: a handle attach got and nobody else destroys.
            unsafe { self.let_go(queue) };
        }
    }

    /// Stop the events of a partition's queue and give its handle back.
    ///
    /// # Safety
    /// `queue` is a live handle `attach` got, not used after this.
    unsafe fn let_go(&self, queue: *mut c_void) {
        // SAFETY: as the caller says; the callback is off (under the queue's lock) before the
        // handle goes.
        unsafe {
            (self.api.queue_cb_event_enable)(queue, None, ptr::null_mut());
            (self.api.queue_destroy)(queue);
        }
    }

    /// Takes up to `raw.len()` messages from `order`'s queues into `raw`, without waiting: each
    /// queue first up to an equal share, then the rest in the same order; no queue more than its
    /// cap. Returns how many were taken.
    fn sweep(&self, order: &[(*mut c_void, usize)], raw: &mut [*mut RawMessage]) -> usize {
        let max = raw.len();
        let mut caps: Vec<usize> = order.iter().map(|&(_, cap)| cap).collect();
        let mut count = 0;
        let share = max.div_ceil(order.len().max(1)).max(1);
        for pass in [share, max] {
            for (&(queue, _), cap) in order.iter().zip(caps.iter_mut()) {
                let want = pass.min(*cap).min(max - count);
                if want == 0 {
                    continue;
                }
                // SAFETY: queue is a live handle (released only under the queues lock, held by the
                // caller); raw has `want` free slots from `count`; every message returned is
                // destroyed by the caller.
                let got = unsafe { (self.api.consume_batch_queue)(queue, 0, raw.as_mut_ptr().add(count), want) };
                let got = got.max(0) as usize;
                count += got;
                // A queue that gave fewer than asked is empty for now: none more from it.
                *cap = if got < want { 0 } else { *cap - got };
            }
        }
        count
    }

    /// Copies up to `max` messages out of librdkafka (no GIL held): those queued now, or when none
    /// are, those queued when the first comes within `timeout_ms` (or `wake` is called). A batch is
    /// what is there, never held back to fill; it takes from the partitions in turn (`sweep`), from
    /// those of `caps` only when given, no more than each one's cap. Without `values` the records'
    /// values are not copied (None).
    fn take(&self, max: usize, timeout_ms: c_int, values: bool, caps: Option<&HashMap<i32, usize>>)
            -> (Vec<Fetched>, Arena, Errors) {
        let mut queues = self.queues.lock().expect("fetch queues lock");
        let mut arena = Arena::default();
        let seen = self.waker.seen();
        let mut order: Vec<(*mut c_void, usize)> = queues.partitions.iter()
            .map(|(partition, &queue)| (queue, caps.map_or(usize::MAX, |caps| caps.get(partition).copied().unwrap_or(0))))
            .filter(|&(_, cap)| cap > 0)
            .collect();
        if !order.is_empty() {
            queues.rotation = (queues.rotation + 1) % order.len();
            order.rotate_left(queues.rotation);
        }
        let mut raw: Vec<*mut RawMessage> = vec![ptr::null_mut(); max.clamp(1, BATCH_MAX)];
        let api = &self.api;
        let mut count = if queues.open { self.sweep(&order, &mut raw) } else { 0 };
        if count == 0 && timeout_ms > 0 && queues.open {
            self.waker.wait(seen, Duration::from_millis(timeout_ms as u64));
            count = self.sweep(&order, &mut raw);
        }
        let mut records = Vec::with_capacity(count);
        let mut errors = Vec::new();
        arena.bytes.reserve(raw.iter().take(count).map(|&message| {
            // SAFETY: librdkafka returned it; it is destroyed below.
            let m = unsafe { &*message };
            m.key_len + 64
        }).sum());
        for &message in raw.iter().take(count) {
            // SAFETY: librdkafka returned it; its fields are valid until message_destroy.
            unsafe {
                let m = &*message;
                if m.err != 0 {
                    let text = CStr::from_ptr((api.err2str)(m.err)).to_string_lossy().into_owned();
                    errors.push((m.partition, m.offset, text));
                } else {
                    records.push(Fetched {
                        partition: m.partition,
                        offset: m.offset,
                        key: arena.copy(m.key, m.key_len),
                        value: if values && !m.payload.is_null() {
                            Some(std::slice::from_raw_parts(m.payload, m.len).into())
                        } else {
                            None
                        },
                        headers: self.headers(message, &mut arena),
                        timestamp_ms: (api.message_timestamp)(message, ptr::null_mut()),
                    });
                }
                (api.message_destroy)(message);
            }
        }
        (records, arena, errors)
    }

    /// A message's headers, packed into the arena (`pack_header`), or None when it has none.
    ///
    /// # Safety
    /// `message` is a live message librdkafka returned.
    unsafe fn headers(&self, message: *const RawMessage, arena: &mut Arena) -> Span {
        let api = &self.api;
        let mut hdrs: *mut c_void = ptr::null_mut();
        if (api.message_headers)(message, &mut hdrs) != 0 || hdrs.is_null() {
            return None;
        }
        let start = arena.bytes.len();
        for index in 0..(api.header_cnt)(hdrs) {
            let (mut name, mut value, mut size): (*const c_char, *const u8, usize) = (ptr::null(), ptr::null(), 0);
            if (api.header_get_all)(hdrs, index, &mut name, &mut value, &mut size) != 0 {
                break;
            }
            let value = if value.is_null() { None } else { Some(std::slice::from_raw_parts(value, size)) };
            pack_header(&mut arena.bytes, CStr::from_ptr(name).to_bytes(), value);
        }
        Some((start, arena.bytes.len()))
    }

    /// The metadata of a record and the headers it keeps: shared per distinct header set.
    fn metadata<'py>(&mut self, py: Python<'py>, refs: &Refs, headers: Option<&[u8]>, partition: i32,
                     offset: i64) -> PyResult<(Py<PyAny>, Py<PyAny>)> {
        let Some(key) = headers else {
            return Ok((refs.empty.clone_ref(py), py.None()));
        };
        if let Some((metadata, shared)) = self.plain.get(key) {
            return Ok((metadata.clone_ref(py), shared.clone_ref(py)));
        }
        let pairs = PyList::empty(py);
        for (name, value) in unpack_headers(key) {
            let value: Bound<'py, PyAny> = match value {
                None => py.None().into_bound(py),
                Some(value) => PyBytes::new(py, value).into_any(),
            };
            let name = PyString::new(py, &String::from_utf8_lossy(name)).into_any();
            pairs.append(PyTuple::new(py, [name, value])?)?;
        }
        // metadata_of(headers, partition, offset) -> (metadata, headers to keep, shareable)
        let (metadata, kept, shareable): (Py<PyAny>, Py<PyAny>, bool) = refs.metadata_of.call1(py, (pairs, partition, offset))?.extract(py)?;
        if shareable && self.plain.len() < 64 {
            self.plain.insert(key.to_vec(), (metadata.clone_ref(py), kept.clone_ref(py)));
        }
        Ok((metadata, kept))
    }
}

#[pymethods]
impl NativeFetch {
    /// Wrap the `rd_kafka_t` of a confluent-kafka `Consumer`.
    ///
    /// `consumer` is the `Consumer` (kept until the fetch is dropped), `handle` its `rd_kafka_t` pointer, `library` the path of the librdkafka confluent-kafka
    /// loaded, `name_prefix` how the name librdkafka reports for the handle begins (checked before use),
    /// `metadata_of(headers, partition, offset)` gives
    /// `(metadata, headers to keep, shareable)` of a record's header list, `empty` the metadata of a record without headers.
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(consumer: Py<PyAny>, handle: usize, library: &str, name_prefix: &str, topic: &str, metadata_of: Py<PyAny>,
           empty: Py<PyAny>) -> PyResult<Self> {
        let api = Api::load(library)?;
        let rk = handle as *mut c_void;
        if rk.is_null() {
            return Err(PyRuntimeError::new_err("no rd_kafka_t"));
        }
        // SAFETY: rk is the handle of a live consumer (the caller keeps the Consumer open).
        let (kind, name) = unsafe { ((api.kind)(rk), CStr::from_ptr((api.name)(rk)).to_string_lossy().into_owned()) };
        if kind != RD_KAFKA_CONSUMER || !name.starts_with(name_prefix) {
            return Err(PyRuntimeError::new_err(format!("handle is {name} (type {kind}), not a consumer named {name_prefix}...")));
        }
        Ok(NativeFetch {
            api,
            rk,
            topic: CString::new(topic).map_err(|_| PyRuntimeError::new_err("bad topic name"))?,
            queues: Mutex::new(Queues { open: true, partitions: BTreeMap::new(), rotation: 0 }),
            waker: Arc::new(Waker::default()),
            refs: Some(Refs { consumer, metadata_of, empty }),
            plain: FastMap::default(),
        })
    }

    /// Split the fetch queues of newly assigned partitions off the consumer queue, to this fetch
    /// (after they are assigned). Once the fetch is closed (the consumer is closing, its last
    /// rebalance may still assign) it attaches nothing.
    fn attach(&self, partitions: Vec<i32>) -> PyResult<()> {
        let mut queues = self.queues.lock().expect("fetch queues lock");
        if !queues.open {
            return Ok(());
        }
        for partition in partitions {
            if queues.partitions.contains_key(&partition) {
                continue;
            }
            // SAFETY: rk is live; the partition queue handle is kept until detach or close, and the
            // waker its events point to lives as long as this fetch (the events are disabled first).
            unsafe {
                let queue = (self.api.queue_get_partition)(self.rk, self.topic.as_ptr(), partition);
                if queue.is_null() {
                    return Err(PyRuntimeError::new_err(format!("no queue for partition {partition}")));
                }
                (self.api.queue_forward)(queue, ptr::null_mut());
                (self.api.queue_cb_event_enable)(queue, Some(queue_event), Arc::as_ptr(&self.waker) as *mut c_void);
                queues.partitions.insert(partition, queue);
            }
        }
        // Records may have come before the events were on: a waiting fetch looks again.
        self.waker.wake();
        Ok(())
    }

    /// Let the fetch queues of partitions let go (before they are unassigned).
    fn detach(&self, partitions: Vec<i32>) {
        let mut queues = self.queues.lock().expect("fetch queues lock");
        for partition in partitions {
            if let Some(queue) = queues.partitions.remove(&partition) {
                // SAFETY: queue is a handle attach got and nobody else destroys.
                unsafe { self.let_go(queue) };
            }
        }
    }

    /// What wakes a fetch waiting for records, from any thread, while the fetch runs
    /// (`FetchWaker.wake`).
    fn waker(&self) -> FetchWaker {
        FetchWaker { waker: Arc::clone(&self.waker) }
    }

    /// The partitions attached to this fetch.
    fn attached(&self) -> Vec<i32> {
        let mut partitions: Vec<i32> = self.queues.lock().expect("fetch queues lock").partitions.keys().copied().collect();
        partitions.sort_unstable();
        partitions
    }

    /// Wait up to `timeout` s for records, from the partitions of `caps` only and no more than each
    /// one's cap when given; returns (records, errors as (partition, offset, text)).
    #[pyo3(signature = (max, timeout, caps=None))]
    fn fetch<'py>(&mut self, py: Python<'py>, max: usize, timeout: f64, caps: Option<HashMap<i32, usize>>)
                  -> PyResult<(Bound<'py, PyList>, Errors)> {
        let timeout_ms = (timeout * 1000.0).round().clamp(0.0, f64::from(i32::MAX)) as c_int;
        let Some(refs) = self.refs.as_ref().map(|refs| Refs {
            consumer: refs.consumer.clone_ref(py),
            metadata_of: refs.metadata_of.clone_ref(py),
            empty: refs.empty.clone_ref(py),
        }) else {
            return Ok((PyList::empty(py), Vec::new()));
        };
        let this = &*self;
        let (fetched, arena, errors) = py.detach(|| this.take(max, timeout_ms, true, caps.as_ref()));
        let records = PyList::empty(py);
        for item in fetched {
            let (metadata, headers) =
                self.metadata(py, &refs, item.headers.map(|span| arena.get(span)), item.partition, item.offset)?;
            let key = match item.key {
                Some(span) if span.1 > span.0 => Some(PyBytes::new(py, arena.get(span)).unbind()),
                _ => None,
            };
            // Out of the cyclic collector's sight (`record.rs`): thousands of records wait in the key
            // queues at a time; tracked, each collection of the young generation walked them and
            // their survival triggered full collections (measured: the history of `bench/RESULTS.md`).
            let record = Bound::new(py, Record::fetched(FetchedFields {
                partition: item.partition,
                offset: item.offset,
                key,
                value: item.value,
                headers,
                metadata,
                timestamp_ms: item.timestamp_ms,
            }))?;
            // SAFETY: the record is alive (we hold it) and was allocated tracked, with the GIL held.
            unsafe { pyo3::ffi::PyObject_GC_UnTrack(record.as_ptr().cast()) };
            records.append(record)?;
        }
        Ok((records, errors))
    }

    /// Read the attached partitions of a topic that grew (SUB-8) for the records of keys a later
    /// count routes elsewhere, without a Python object for any other record: the records queued
    /// (or the first within `timeout` s and those queued with it, as `fetch`), each looked at
    /// without the GIL; returns `[(partition, offset, key, count it was published under), ...]` for
    /// those below their partition's end in `ends` whose key moves by the history `counts`
    /// (`[(count, since_ms), ...]`, ascending). The count is the record's `ol-partition-count`
    /// header, else the count in force at its append time.
    fn scan_moving<'py>(&self, py: Python<'py>, max: usize, timeout: f64, counts: Vec<(u32, i64)>,
                        ends: HashMap<i32, i64>) -> Vec<(i32, i64, Bound<'py, PyBytes>, u32)> {
        let timeout_ms = (timeout * 1000.0).round().clamp(0.0, f64::from(i32::MAX)) as c_int;
        let Some(moves) = Moves::new(0, counts) else { return Vec::new() };
        let this = self;
        let found: Vec<(i32, i64, Vec<u8>, u32)> = py.detach(|| {
            let (fetched, arena, _errors) = this.take(max, timeout_ms, false, None);
            let mut found = Vec::new();
            for item in fetched {
                let (Some(span), Ok(partition)) = (item.key, u32::try_from(item.partition)) else { continue };
                if ends.get(&item.partition).is_none_or(|&end| item.offset >= end) {
                    continue;
                }
                let key = arena.get(span);
                let hash = murmur2(key) & 0x7fff_ffff;
                if !moves.later().any(|count| hash % count != partition) {
                    continue;
                }
                let published = item.headers.map_or(0, |span| partition_count_header(arena.get(span)));
                found.push((item.partition, item.offset, key.to_vec(), moves.count_at(published, item.timestamp_ms)));
            }
            found
        });
        found.into_iter().map(|(partition, offset, key, count)| (partition, offset, PyBytes::new(py, &key), count))
            .collect()
    }

    /// Give every queue back to librdkafka (before the consumer closes; also done when the fetch is
    /// dropped, before it lets the consumer go).
    fn close(&mut self) {
        self.release();
        self.refs = None;
        self.plain.clear();
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Some(refs) = &self.refs {
            for object in [&refs.consumer, &refs.metadata_of, &refs.empty] {
                visit.call(object)?;
            }
        }
        for (metadata, headers) in self.plain.values() {
            visit.call(metadata)?;
            visit.call(headers)?;
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_partition_count_header_is_read_from_packed_headers() {
        let mut packed = Vec::new();
        pack_header(&mut packed, b"ol-message-id", Some(b"x"));
        pack_header(&mut packed, b"ol-partition-count", Some(b"18"));
        assert_eq!(partition_count_header(&packed), 18);
        let mut bad = Vec::new();
        pack_header(&mut bad, b"ol-partition-count", Some(b"many"));
        assert_eq!((partition_count_header(&bad), partition_count_header(&[])), (0, 0));
    }

    #[test]
    fn packed_headers_unpack_to_the_pairs_packed() {
        let pairs: Vec<(&[u8], Option<&[u8]>)> =
            vec![(b"ol-partition-count", Some(b"6")), (b"", None), (b"empty", Some(b"")), ("n\u{e9}".as_bytes(), Some(&[0, 255]))];
        let mut packed = Vec::new();
        for (name, value) in &pairs {
            pack_header(&mut packed, name, *value);
        }
        assert_eq!(unpack_headers(&packed), pairs);
        assert!(unpack_headers(&[]).is_empty());
    }

    #[test]
    fn an_arena_hands_back_what_it_copied() {
        let mut arena = Arena::default();
        let (key, value) = (b"key".to_vec(), b"value".to_vec());
        // SAFETY: the pointers are the vectors' own, with their lengths.
        let (a, b, none) = unsafe {
            (arena.copy(key.as_ptr(), key.len()), arena.copy(value.as_ptr(), value.len()), arena.copy(ptr::null(), 5))
        };
        assert_eq!((arena.get(a.unwrap()), arena.get(b.unwrap()), none), (&b"key"[..], &b"value"[..], None));
    }
}
