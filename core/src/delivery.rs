//! `Delivery`: one hand-off of a record, compiled; `AckQueue`: where plain acks go without Python.
//!
//! A `Delivery` holds what a hand-off is (its record, queue key, token, attempt, lease handle, topic
//! and owner epoch) as fields fixed when it is made, and what changes (whether it was acked or
//! nacked, where its requests go) in atomics and a short lock that is never held while Python
//! runs: a message is read and settled by several threads at once (the engine, workers, user code),
//! so no borrow of it can be left open across Python code. `ordering_layer.subscriber.message.Message`
//! is a Python subclass (no slots of its own) that adds the Pub/Sub and confluent-kafka accessors;
//! the core makes each `Message` of a release through `Delivery`'s `tp_new`, with the fields handed
//! over in a thread-local, so no argument tuple is built and no `__init__` runs.
//!
//! A plain `ack()`, when it is the first request of a released delivery, puts the delivery's lease
//! handle in its engine's `AckQueue`, without running Python: the coordinator settles the queue's
//! handles in one call (`LeaseTable.ack_queued`) before the events of the same step (so an ack stays
//! ahead of any request made after it, which goes through the inbox). Only the first post to a
//! queue the engine armed before it sleeps calls Python, to wake it (`Inbox.nudge`).

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use pyo3::exceptions::{PyRuntimeError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::intern;
use pyo3::types::{PyBytes, PyList, PyTuple, PyType};
use pyo3::{PyTraverseError, PyTypeInfo, PyVisit};

use crate::record::Record;

/// `settled` bits: an ack was requested; a nack was (it stays the message's last word).
const SETTLED: u8 = 1;
const NACKED: u8 = 2;
/// Some request (ack, nack, deadline change) was made: later plain acks go through the inbox, in
/// order after it.
const SENT: u8 = 4;

/// `SettleKind` (`ordering_layer/subscriber/requests.py`).
const KIND_ACK: u8 = 0;
const KIND_NACK: u8 = 1;

fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Plain acks posted by any thread, taken by the engine's coordinator (lease handles, in order).
#[pyclass(module = "ordering_layer._core", name = "AckQueue", frozen)]
pub struct AckQueue {
    pending: Mutex<Pending>,
    waker: Py<PyAny>,
}

#[derive(Default)]
struct Pending {
    handles: Vec<u64>,
    armed: bool,
}

impl AckQueue {
    /// Queue one handle; wake the engine when it armed the queue before sleeping.
    fn push(&self, py: Python<'_>, handle: u64) -> PyResult<()> {
        self.push_all(py, &[handle])
    }

    /// Queue handles in order; wake the engine (once) when it armed the queue before sleeping.
    fn push_all(&self, py: Python<'_>, handles: &[u64]) -> PyResult<()> {
        let wake = {
            let mut pending = locked(&self.pending);
            pending.handles.extend_from_slice(handles);
            std::mem::replace(&mut pending.armed, false)
        };
        if wake {
            self.waker.call0(py)?;
        }
        Ok(())
    }

    /// Every handle queued now, oldest first; the queue is emptied.
    pub fn drain(&self) -> Vec<u64> {
        std::mem::take(&mut locked(&self.pending).handles)
    }
}

#[pymethods]
impl AckQueue {
    /// `waker`: called (no arguments) by the first post after `arm`.
    #[new]
    fn new(waker: Py<PyAny>) -> Self {
        AckQueue { pending: Mutex::new(Pending::default()), waker }
    }

    /// Queue an ack of the delivery with lease handle `handle` (any thread).
    fn post(&self, py: Python<'_>, handle: u64) -> PyResult<()> {
        self.push(py, handle)
    }

    /// The engine is about to sleep: the next post wakes it. False (not armed) when acks are
    /// waiting already: it should not sleep.
    fn arm(&self) -> bool {
        let mut pending = locked(&self.pending);
        pending.armed = pending.handles.is_empty();
        pending.armed
    }

    /// The engine is awake: posts do not wake it.
    fn disarm(&self) {
        locked(&self.pending).armed = false;
    }

    /// Every handle queued now, oldest first (the queue is emptied).
    fn take(&self) -> Vec<u64> {
        self.drain()
    }

    fn __len__(&self) -> usize {
        locked(&self.pending).handles.len()
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.waker)
    }
}

/// One hand-off of a record (see the module's documentation).
#[pyclass(module = "ordering_layer._core", name = "Delivery", subclass, frozen)]
pub struct Delivery {
    record: Py<PyAny>,
    queue_key: Py<PyAny>,
    token: u64,
    pub attempt: i64,
    pub lease: u64,
    topic: Py<PyAny>,
    epoch: i64,
    submit: Mutex<Py<PyAny>>,
    /// Where a first plain ack goes (released by an engine), unless `_submit` was replaced.
    acks: Option<Py<AckQueue>>,
    submit_replaced: AtomicBool,
    state: AtomicU8,
}

thread_local! {
    /// The fields of the delivery `tp_new` is making for `Maker::make` on this thread.
    static PENDING: RefCell<Option<Delivery>> = const { RefCell::new(None) };
}

/// The fields of a delivery the core makes (see `Maker::make`).
pub struct Fields {
    pub record: Py<PyAny>,
    pub queue_key: Py<PyAny>,
    pub token: u64,
    pub attempt: i64,
    pub lease: u64,
    pub topic: Py<PyAny>,
    pub epoch: i64,
    pub submit: Py<PyAny>,
    pub acks: Option<Py<AckQueue>>,
}

impl Delivery {
    fn of(fields: Fields) -> Self {
        Delivery {
            record: fields.record,
            queue_key: fields.queue_key,
            token: fields.token,
            attempt: fields.attempt,
            lease: fields.lease,
            topic: fields.topic,
            epoch: fields.epoch,
            submit: Mutex::new(fields.submit),
            acks: fields.acks,
            submit_replaced: AtomicBool::new(false),
            state: AtomicU8::new(0),
        }
    }

    /// Mark a plain ack: the ack queue its handle goes to when it is the first request of a released
    /// message whose `_submit` was not replaced; None: it goes to `_submit`.
    fn ack_queue(&self) -> Option<&Py<AckQueue>> {
        let before = self.mark(KIND_ACK);
        let first = before & SENT == 0 && self.lease != 0 && !self.submit_replaced.load(Ordering::Acquire);
        if first { self.acks.as_ref() } else { None }
    }

    /// Mark a request of `kind` (`SettleKind`): any request sets SENT; a nack sets NACKED for good;
    /// an ack sets SETTLED unless nacked. Returns the bits before.
    fn mark(&self, kind: u8) -> u8 {
        let bits = if kind == KIND_NACK { NACKED | SENT } else { SENT };
        let before = self.state.fetch_or(bits, Ordering::AcqRel);
        if kind == KIND_ACK && before & NACKED == 0 {
            self.state.fetch_or(SETTLED, Ordering::AcqRel);
        }
        before
    }
}

#[pymethods]
impl Delivery {
    /// `Delivery(record, queue_key, token, attempt)`; `Message` adds `topic, epoch, submit, lease`.
    #[new]
    #[pyo3(signature = (record = None, queue_key = None, token = 0, attempt = 0, topic = None, epoch = 0,
                        submit = None, lease = 0))]
    #[allow(clippy::too_many_arguments)] // the arguments of the Python constructor
    fn new(py: Python<'_>, record: Option<Py<PyAny>>, queue_key: Option<Py<PyAny>>, token: u64, attempt: i64,
           topic: Option<Py<PyAny>>, epoch: i64, submit: Option<Py<PyAny>>, lease: u64) -> PyResult<Self> {
        if let Some(pending) = PENDING.with(|pending| pending.borrow_mut().take()) {
            return Ok(pending);
        }
        let record = record.ok_or_else(|| PyTypeError::new_err("a delivery needs a record"))?;
        Ok(Delivery::of(Fields {
            record,
            queue_key: queue_key.unwrap_or_else(|| py.None()),
            token,
            attempt,
            lease,
            topic: topic.unwrap_or_else(|| py.None()),
            epoch,
            submit: submit.unwrap_or_else(|| py.None()),
            acks: None,
        }))
    }

    #[getter]
    fn record(&self, py: Python<'_>) -> Py<PyAny> {
        self.record.clone_ref(py)
    }

    #[getter]
    fn queue_key(&self, py: Python<'_>) -> Py<PyAny> {
        self.queue_key.clone_ref(py)
    }

    /// The record's `suspect` (read per message by the callback workers: one call, no record
    /// object made).
    #[getter]
    fn suspect(&self, py: Python<'_>) -> PyResult<bool> {
        let record = self.record.bind(py);
        match record.cast::<Record>() {
            Ok(record) => Ok(record.get().is_suspect()),
            Err(_) => record.getattr(intern!(py, "suspect"))?.is_truthy(),
        }
    }

    #[getter]
    fn token(&self) -> u64 {
        self.token
    }

    #[getter(attempt)]
    fn get_attempt(&self) -> i64 {
        self.attempt
    }

    #[getter]
    fn lease(&self) -> u64 {
        self.lease
    }

    #[getter]
    fn _topic(&self, py: Python<'_>) -> Py<PyAny> {
        self.topic.clone_ref(py)
    }

    #[getter]
    fn _epoch(&self) -> i64 {
        self.epoch
    }

    /// Where the delivery's requests go (the engine's inbox; a tracing wrapper once replaced).
    #[getter]
    fn _submit(&self, py: Python<'_>) -> Py<PyAny> {
        locked(&self.submit).clone_ref(py)
    }

    /// Replaced (tracing): every request goes there from now on, plain acks included.
    #[setter(_submit)]
    fn set_submit(&self, submit: Py<PyAny>) {
        self.submit_replaced.store(true, Ordering::Release);
        let old = std::mem::replace(&mut *locked(&self.submit), submit);
        drop(old); // outside the lock: dropping may run Python
    }

    /// False; True once an ack was sent; 2 (`message.NACKED`) once a nack was, whatever came after.
    #[getter]
    fn settled(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let state = self.state.load(Ordering::Acquire);
        Ok(if state & NACKED != 0 {
            2_i64.into_pyobject(py)?.into_any().unbind()
        } else {
            pyo3::types::PyBool::new(py, state & SETTLED != 0).to_owned().into_any().unbind()
        })
    }

    /// Mark the delivery as `message._send` does for a request of `kind` (`SettleKind`): a nack sets
    /// NACKED for good, an ack sets settled unless nacked; any request makes later plain acks go
    /// through the inbox, after it.
    fn _mark(&self, kind: u8) {
        self.mark(kind);
    }

    /// Mark a plain ack and, when it is the first request of a released message whose `_submit` was
    /// not replaced, put it in its engine's ack queue: True. False: the caller hands the message to
    /// `_submit` (as `ack` does; `message.ack_all` gathers them per engine).
    fn _ack_queued(&self, py: Python<'_>) -> PyResult<bool> {
        match self.ack_queue() {
            Some(acks) => {
                acks.get().push(py, self.lease)?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Done with the message: it is settled and never delivered again (unless a cascade). The first
    /// request of a released message goes to its engine's ack queue; any other to `_submit`.
    fn ack(slf: &Bound<'_, Self>) -> PyResult<()> {
        let (this, py) = (slf.get(), slf.py());
        if this._ack_queued(py)? {
            return Ok(());
        }
        let submit = locked(&this.submit).clone_ref(py);
        if submit.is_none(py) {
            return Err(PyRuntimeError::new_err("this message was not released by a subscriber"));
        }
        submit.call1(py, (slf,))?;
        Ok(())
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let record = self.record.bind(py);
        Ok(format!("Delivery({}:{}, key={}, token={}, attempt={})", record.getattr("partition")?,
                   record.getattr("offset")?, self.queue_key.bind(py).repr()?, self.token, self.attempt))
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.record)?;
        visit.call(&self.queue_key)?;
        visit.call(&self.topic)?;
        if let Ok(submit) = self.submit.try_lock() {
            visit.call(&*submit)?;
        }
        if let Some(acks) = &self.acks {
            visit.call(acks)?;
        }
        Ok(())
    }
}

/// Makes instances of one subclass of `Delivery` (`Message`) from `Fields`, through `Delivery`'s
/// own `tp_new` (not the subclass's, which Python code could override).
pub struct Maker {
    class: Py<PyType>,
    new: ffi::newfunc,
    empty: Py<PyTuple>,
    gc: bool,
}

impl Maker {
    /// Raises TypeError when `class` is not a subclass of `Delivery`.
    pub fn new(class: &Bound<'_, PyType>) -> PyResult<Self> {
        let py = class.py();
        let base = Delivery::type_object(py);
        if !class.is_subclass(&base)? {
            return Err(PyTypeError::new_err(format!("{} is not a Delivery", class.name()?)));
        }
        // SAFETY: `base` is a type object (held); its `tp_new` slot is pyo3's, never null.
        let (new, flags) = unsafe {
            let slot = ffi::PyType_GetSlot(base.as_ptr().cast(), ffi::Py_tp_new);
            if slot.is_null() {
                return Err(PyTypeError::new_err("Delivery has no tp_new"));
            }
            (std::mem::transmute::<*mut std::ffi::c_void, ffi::newfunc>(slot),
             ffi::PyType_GetFlags(class.as_ptr().cast()))
        };
        Ok(Maker { class: class.clone().unbind(), new, empty: PyTuple::empty(py).unbind(),
                   gc: flags & ffi::Py_TPFLAGS_HAVE_GC != 0 })
    }

    /// A new instance of the class with `fields`, without running `__init__`; out of the cyclic
    /// collector's sight (see `Deliveries::make`).
    pub fn make<'py>(&self, py: Python<'py>, fields: Fields) -> PyResult<Bound<'py, PyAny>> {
        PENDING.with(|pending| *pending.borrow_mut() = Some(Delivery::of(fields)));
        // SAFETY: `new` is `Delivery`'s tp_new, called with a subclass of it, an empty argument
        // tuple and no keywords, with the GIL held; it takes the pending fields.
        let made = unsafe { (self.new)(self.class.as_ptr().cast(), self.empty.as_ptr(), std::ptr::null_mut()) };
        PENDING.with(|pending| pending.borrow_mut().take()); // left there only when tp_new failed early
        if made.is_null() {
            return Err(PyErr::fetch(py));
        }
        // SAFETY: a new reference, owned here.
        let made = unsafe { Bound::from_owned_ptr(py, made) };
        if self.gc {
            // SAFETY: the object is alive (held) and of a collected class, tracked when allocated.
            unsafe { ffi::PyObject_GC_UnTrack(made.as_ptr().cast()) };
        }
        Ok(made)
    }

    pub fn traverse(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.class)
    }
}

/// An item's queue key: a `Delivery`'s field, or the attribute of any other object.
pub fn queue_key_of<'py>(item: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    match item.cast::<Delivery>() {
        Ok(delivery) => Ok(delivery.get().queue_key.bind(item.py()).clone()),
        Err(_) => item.getattr(intern!(item.py(), "queue_key")),
    }
}

/// An item's partition: its record's (a compiled `Record`'s field, or the attribute).
pub fn partition_of(item: &Bound<'_, PyAny>) -> PyResult<i64> {
    let py = item.py();
    let record = match item.cast::<Delivery>() {
        Ok(delivery) => delivery.get().record.bind(py).clone(),
        Err(_) => item.getattr(intern!(py, "record"))?,
    };
    match record.cast::<Record>() {
        Ok(record) => Ok(i64::from(record.get().partition)),
        Err(_) => record.getattr(intern!(py, "partition"))?.extract(),
    }
}

/// The items of `messages` not settled yet (no ack or nack requested: `settled` false), in order.
#[pyfunction]
pub fn unsettled<'py>(messages: &Bound<'py, PyList>) -> PyResult<Bound<'py, PyList>> {
    let kept = PyList::empty(messages.py());
    for item in messages.iter() {
        let open = match item.cast::<Delivery>() {
            Ok(delivery) => delivery.get().state.load(Ordering::Acquire) & (SETTLED | NACKED) == 0,
            Err(_) => !item.getattr(intern!(messages.py(), "settled"))?.is_truthy()?,
        };
        if open {
            kept.append(item)?;
        }
    }
    Ok(kept)
}

/// Two queue keys are the same key: the same object, equal bytes, or equal by `==`.
pub fn same_key(a: &Bound<'_, PyAny>, b: &Bound<'_, PyAny>) -> PyResult<bool> {
    if a.is(b) {
        return Ok(true);
    }
    match (a.cast::<PyBytes>(), b.cast::<PyBytes>()) {
        (Ok(a), Ok(b)) => Ok(a.as_bytes() == b.as_bytes()),
        _ => a.eq(b),
    }
}

/// A released batch as the callback hand-outs queue it (`ordering_layer.subscriber.runs`): each
/// run of consecutive messages with the same queue key as one list, any other message as it is.
/// A new list either way.
#[pyfunction]
pub fn items_of<'py>(messages: &Bound<'py, PyList>) -> PyResult<Bound<'py, PyList>> {
    let py = messages.py();
    let keys = messages.iter().map(|message| queue_key_of(&message)).collect::<PyResult<Vec<_>>>()?;
    let mut starts = Vec::new(); // where each item begins
    for (index, key) in keys.iter().enumerate() {
        if index == 0 || !same_key(&keys[index - 1], key)? {
            starts.push(index);
        }
    }
    if starts.len() == keys.len() {
        return Ok(messages.get_slice(0, keys.len()));
    }
    starts.push(keys.len());
    let items = PyList::empty(py);
    for bounds in starts.windows(2) {
        if bounds[1] - bounds[0] == 1 {
            items.append(messages.get_item(bounds[0])?)?;
        } else {
            items.append(messages.get_slice(bounds[0], bounds[1]))?;
        }
    }
    Ok(items)
}

/// A delivery's lease handle: a `Delivery`'s field, or the attribute of any other object.
pub fn handle_of(item: &Bound<'_, PyAny>) -> PyResult<u64> {
    match item.cast::<Delivery>() {
        Ok(delivery) => Ok(delivery.get().lease),
        Err(_) => item.getattr(intern!(item.py(), "lease"))?.extract(),
    }
}

/// An item's attempt: a `Delivery`'s field, or the attribute of any other object.
pub fn attempt_of(item: &Bound<'_, PyAny>) -> PyResult<i64> {
    match item.cast::<Delivery>() {
        Ok(delivery) => Ok(delivery.get().attempt),
        Err(_) => item.getattr(intern!(item.py(), "attempt"))?.extract(),
    }
}

/// Plain acks of many messages (`message.ack_all`), marked in order: each first request of a
/// released message goes to its engine's ack queue (a run of them to one queue in one go, the engine
/// woken at most once for it). Returns the other messages, in order, for their `_submit`. An item
/// that is not a `Delivery` is asked through its `_ack_queued()`.
#[pyfunction]
pub fn ack_queued_all<'py>(messages: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
    let py = messages.py();
    let items = messages.try_iter()?.collect::<PyResult<Vec<_>>>()?;
    let rest = PyList::empty(py);
    let mut run: Option<(&Py<AckQueue>, Vec<u64>)> = None; // the latest acks' queue and their handles
    for item in &items {
        let Ok(delivery) = item.cast::<Delivery>() else {
            if let Some((queue, handles)) = run.take() {
                queue.get().push_all(py, &handles)?;
            }
            if !item.call_method0(intern!(py, "_ack_queued"))?.is_truthy()? {
                rest.append(item)?;
            }
            continue;
        };
        let this = delivery.get();
        match (this.ack_queue(), &mut run) {
            (Some(queue), Some((current, handles))) if queue.is(*current) => handles.push(this.lease),
            (Some(queue), _) => {
                if let Some((current, handles)) = run.replace((queue, vec![this.lease])) {
                    current.get().push_all(py, &handles)?;
                }
            }
            (None, _) => rest.append(item)?,
        }
    }
    if let Some((queue, handles)) = run {
        queue.get().push_all(py, &handles)?;
    }
    Ok(rest)
}

/// How many of `messages` are not a first attempt (`attempt` above 1).
#[pyfunction]
pub fn redeliveries(messages: &Bound<'_, PyList>) -> PyResult<usize> {
    let mut count = 0;
    for message in messages.iter() {
        count += usize::from(attempt_of(&message)? != 1);
    }
    Ok(count)
}
