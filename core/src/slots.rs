//! Instances of a Python class with `__slots__`, made without running its `__init__`.
//!
//! The subscriber makes a `Record` per fetched record. Calling the class runs its `__init__`, a
//! Python frame that stores each slot in turn (about 120 ns each, measured: the history of
//! `bench/RESULTS.md`); records are plain slot holders, so `SlotLayout` allocates one (`PyType_GenericAlloc`, as calling the class does) and stores the values in its
//! slots directly. A slot of such a class is a `PyObject *` at a fixed offset in the instance; the
//! offsets are found once per class by storing a fresh object in each named slot of a probe
//! instance and looking for its address in the instance's memory (`__basicsize__` bytes), so no
//! interpreter struct layout is assumed. A class with a `__dict__`, a slot not found exactly once,
//! or two names at one offset is refused.

use pyo3::exceptions::PyTypeError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::{PyTraverseError, PyVisit};
use pyo3::types::{PyList, PyTuple, PyType};

const POINTER: usize = std::mem::size_of::<*mut ffi::PyObject>();

/// The `Record` slots the core fills and reads (`ordering_layer.subscriber.key_queue.Record`), by
/// name: a layout's values come in this order, whatever the order of the class's fields.
pub const RECORD_FIELDS: [&str; 12] = ["partition", "offset", "key", "value", "headers", "metadata", "size",
                                       "timestamp_ms", "attempts", "last_error", "suspect", "quarantined"];
/// The position of `name` in `names`, at compile time (a misspelt name does not build).
pub const fn field(names: &[&str], name: &str) -> usize {
    let mut index = 0;
    while index < names.len() {
        if same(names[index].as_bytes(), name.as_bytes()) {
            return index;
        }
        index += 1;
    }
    panic!("no such field");
}

const fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut index = 0;
    while index < a.len() {
        if a[index] != b[index] {
            return false;
        }
        index += 1;
    }
    true
}

/// Where the named slots of one class are, in the order named.
#[pyclass(module = "ordering_layer._core", name = "SlotLayout", frozen)]
pub struct SlotLayout {
    class: Py<PyType>,
    offsets: Vec<usize>,
    names: Vec<String>,
}

impl SlotLayout {
    /// A new instance with `values` in the named slots, in order (each taken as a new reference);
    /// the slots left unnamed are empty (reading one raises AttributeError).
    pub fn make<'py>(&self, py: Python<'py>, values: &[Bound<'py, PyAny>]) -> PyResult<Bound<'py, PyAny>> {
        if values.len() != self.offsets.len() {
            return Err(PyTypeError::new_err(format!("{} values for {} slots", values.len(), self.offsets.len())));
        }
        // SAFETY: the class is a type object (held); the new instance is ours alone until returned.
        let object = unsafe {
            let raw = ffi::PyType_GenericAlloc(self.class.as_ptr().cast(), 0);
            if raw.is_null() {
                return Err(PyErr::fetch(py));
            }
            Bound::from_owned_ptr(py, raw)
        };
        for (&offset, value) in self.offsets.iter().zip(values) {
            // SAFETY: `offset` is a slot of this class (found in `new`), empty in a new instance.
            unsafe { *slot(&object, offset) = value.clone().into_ptr() };
        }
        Ok(object)
    }

    /// Replace the value of named slot `index` of `object`, an instance of the class.
    ///
    /// # Safety
    /// `object` is an instance of exactly this layout's class.
    pub unsafe fn set(&self, object: &Bound<'_, PyAny>, index: usize, value: Bound<'_, PyAny>) {
        let place = slot(object, self.offsets[index]);
        let old = std::mem::replace(&mut *place, value.into_ptr());
        ffi::Py_XDECREF(old);
    }

    /// The value of named slot `index` of `object`, an instance of the class (None when empty).
    ///
    /// # Safety
    /// `object` is an instance of exactly this layout's class.
    pub unsafe fn get<'py>(&self, object: &Bound<'py, PyAny>, index: usize) -> Bound<'py, PyAny> {
        let value = *slot(object, self.offsets[index]);
        if value.is_null() {
            object.py().None().into_bound(object.py())
        } else {
            Bound::from_borrowed_ptr(object.py(), value)
        }
    }

    /// Whether the layout names exactly `expected`, in that order (the core reads slots by position
    /// in its own list of names).
    pub fn names_are(&self, expected: &[&str]) -> bool {
        self.names.len() == expected.len() && self.names.iter().zip(expected).all(|(name, wanted)| name == wanted)
    }

    /// Whether `object` is an instance of exactly this layout's class (not a subclass).
    pub fn is_instance(&self, object: &Bound<'_, PyAny>) -> bool {
        object.get_type().as_ptr() == self.class.as_ptr()
    }
}

/// The address of the slot at `offset` in `object`.
///
/// # Safety
/// `offset` lies within the object's basic size.
unsafe fn slot(object: &Bound<'_, PyAny>, offset: usize) -> *mut *mut ffi::PyObject {
    object.as_ptr().cast::<u8>().add(offset).cast::<*mut ffi::PyObject>()
}

#[pymethods]
impl SlotLayout {
    /// The layout of `class`'s slots `names`.
    ///
    /// Raises:
    ///     TypeError: instances of `class` have a `__dict__`, or a name is not one slot of it.
    #[new]
    fn new(class: &Bound<'_, PyType>, names: Vec<String>) -> PyResult<Self> {
        let py = class.py();
        let basic_size: usize = class.getattr("__basicsize__")?.extract()?;
        let dict_offset: isize = class.getattr("__dictoffset__")?.extract()?;
        let item_size: usize = class.getattr("__itemsize__")?.extract()?;
        if dict_offset != 0 || item_size != 0 {
            return Err(PyTypeError::new_err(format!("{} instances are not plain slot holders", class.name()?)));
        }
        let probe = py.get_type::<pyo3::types::PyAny>().call_method1("__new__", (class,))?;
        let mut offsets = Vec::with_capacity(names.len());
        for name in &names {
            let marker = PyList::empty(py);
            let not_a_slot = || PyTypeError::new_err(format!("{name:?} is not one slot of {}", class.name().map(|n| n.to_string()).unwrap_or_default()));
            probe.setattr(name.as_str(), &marker).map_err(|_| not_a_slot())?;
            let found: Vec<usize> = (std::mem::size_of::<ffi::PyObject>()..basic_size)
                .step_by(POINTER)
                .filter(|&offset| {
                    // SAFETY: the offset lies within the probe instance's basic size.
                    unsafe { *slot(&probe, offset) == marker.as_ptr() }
                })
                .collect();
            match found[..] {
                [offset] if !offsets.contains(&offset) => offsets.push(offset),
                _ => return Err(not_a_slot()),
            }
        }
        Ok(SlotLayout { class: class.clone().unbind(), offsets, names })
    }

    /// The slots named, in order.
    #[getter]
    fn names(&self) -> Vec<String> {
        self.names.clone()
    }

    /// A new instance with `values` in the named slots, in order, without running `__init__`.
    #[pyo3(signature = (*values))]
    fn new_instance<'py>(&self, py: Python<'py>, values: &Bound<'py, PyTuple>) -> PyResult<Bound<'py, PyAny>> {
        let values: Vec<Bound<'py, PyAny>> = values.iter().collect();
        self.make(py, &values)
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.class)
    }
}
