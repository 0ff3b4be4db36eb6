//! `views`: every loaded tensor's NumPy view in one call, through NumPy's C API.
//!
//! `np.frombuffer(...).reshape(...)` costs about a microsecond of Python per tensor; a
//! checkpoint of 16k small tensors spent more time there than in the load itself. Here
//! each view is one `PyArray_NewFromDescr` over the caller's buffer, with the buffer's
//! owner (a memoryview) as the array's base, exactly what `np.frombuffer` makes.
//!
//! Only two entries of NumPy's API table are used, fetched from the `_ARRAY_API`
//! capsule NumPy publishes for extensions (its function indices are fixed across NumPy
//! 1.x and 2.x). Anything unusual (strings, sub-byte types, empty tensors, bytes that
//! do not fill the dims) is left to Python, which makes or refuses it as before.

use std::ffi::{c_int, c_void};

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyImportError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyList, PyTuple};

type NpyIntp = ffi::Py_ssize_t;
/// `PyArray_NewFromDescr(subtype, descr, nd, dims, strides, data, flags, obj)`; steals `descr`.
type NewFromDescr = unsafe extern "C" fn(
    *mut ffi::PyTypeObject,
    *mut ffi::PyObject,
    c_int,
    *const NpyIntp,
    *const NpyIntp,
    *mut c_void,
    c_int,
    *mut ffi::PyObject,
) -> *mut ffi::PyObject;
/// `PyArray_SetBaseObject(array, base)`; steals `base`, even on failure.
type SetBaseObject = unsafe extern "C" fn(*mut ffi::PyObject, *mut ffi::PyObject) -> c_int;

// Indices into NumPy's API table (numpy/_core/code_generators/numpy_api.py).
const PYARRAY_TYPE: usize = 2;
const PYARRAY_NEW_FROM_DESCR: usize = 94;
const PYARRAY_SET_BASE_OBJECT: usize = 282;
const NPY_ARRAY_C_CONTIGUOUS: c_int = 0x0001;
const NPY_ARRAY_WRITEABLE: c_int = 0x0400;
/// NumPy 1.x's limit on dimensions (2.x allows 64): a tensor with more goes the Python way.
const MAX_DIMS: usize = 32;

/// The NumPy functions used here, resolved once per process.
struct NumPy {
    array_type: *mut ffi::PyTypeObject,
    new_from_descr: NewFromDescr,
    set_base_object: SetBaseObject,
}

// SAFETY: function pointers and a static type object of an imported module that is
// never unloaded; they are only called with the GIL held.
unsafe impl Send for NumPy {}
// SAFETY: as above.
unsafe impl Sync for NumPy {}

static NUMPY: PyOnceLock<NumPy> = PyOnceLock::new();

fn numpy(py: Python<'_>) -> PyResult<&'static NumPy> {
    NUMPY.get_or_try_init(py, || {
        let module = py
            .import("numpy._core.multiarray")
            .or_else(|_| py.import("numpy.core.multiarray"))?;
        let capsule = module.getattr("_ARRAY_API")?;
        // SAFETY: PyCapsule_GetPointer checks the object is a capsule (NumPy's is unnamed)
        // and sets an exception otherwise.
        let table = unsafe { ffi::PyCapsule_GetPointer(capsule.as_ptr(), std::ptr::null()) };
        if table.is_null() {
            return Err(PyErr::take(py)
                .unwrap_or_else(|| PyImportError::new_err("NumPy's _ARRAY_API capsule is empty")));
        }
        let table = table.cast::<*const c_void>();
        // SAFETY: the capsule points at NumPy's API table, which holds these entries
        // (and many more) for every NumPy this package supports; a null entry is refused.
        let entry = |i: usize| unsafe { *table.add(i) };
        let (array_type, new, set_base) = (
            entry(PYARRAY_TYPE),
            entry(PYARRAY_NEW_FROM_DESCR),
            entry(PYARRAY_SET_BASE_OBJECT),
        );
        if array_type.is_null() || new.is_null() || set_base.is_null() {
            return Err(PyImportError::new_err("NumPy's API table lacks an entry"));
        }
        Ok(NumPy {
            array_type: array_type as *mut ffi::PyTypeObject,
            // SAFETY: the entries at these indices are functions of these signatures.
            new_from_descr: unsafe { std::mem::transmute::<*const c_void, NewFromDescr>(new) },
            // SAFETY: as above.
            set_base_object: unsafe {
                std::mem::transmute::<*const c_void, SetBaseObject>(set_base)
            },
        })
    })
}

/// One mapping the views are cut from: its bytes, and the object their arrays keep alive.
struct Source<'py> {
    base: Bound<'py, PyAny>,
    start: *mut u8,
    len: usize,
    writable: bool,
    /// Held for the call: the bytes stay put while we read the pointer.
    _buffer: PyBuffer<u8>,
}

impl<'py> Source<'py> {
    fn of(base: Option<Bound<'py, PyAny>>) -> PyResult<Option<Self>> {
        let Some(base) = base else { return Ok(None) };
        let buffer = PyBuffer::<u8>::get(&base)?;
        if !buffer.is_c_contiguous() {
            return Ok(None);
        }
        Ok(Some(Source {
            start: buffer.buf_ptr().cast(),
            len: buffer.len_bytes(),
            writable: !buffer.readonly(),
            base,
            _buffer: buffer,
        }))
    }
}

/// Views over `mappings` (checkpoint, external data: memoryviews, or None where Python
/// reads the values itself) for `entries`, the (name, code, dims, stored) tuples a load
/// gives. `dtypes[code]` is (dtype, itemsize), or None for a type Python handles. Returns
/// one item per entry: the array (read-only exactly when its memoryview is), or None
/// where Python makes the value (or the error) as before, and for anything that is not
/// such a tuple.
#[pyfunction]
pub fn views<'py>(
    py: Python<'py>,
    entries: &Bound<'py, PyList>,
    mappings: (Option<Bound<'py, PyAny>>, Option<Bound<'py, PyAny>>),
    dtypes: Vec<Option<(Bound<'py, PyAny>, usize)>>,
) -> PyResult<Bound<'py, PyList>> {
    super::guarded(py, || {
        let cutter = Cutter::new(py, mappings, &dtypes)?;
        let none = py.None().into_bound(py);
        let mut out = Vec::with_capacity(entries.len());
        for entry in entries.iter() {
            out.push(
                cutter
                    .view_of_entry(&entry)?
                    .unwrap_or_else(|| none.clone()),
            );
        }
        PyList::new(py, out)
    })
}

/// Cuts views out of a load's mappings: what every view of one call shares.
pub(super) struct Cutter<'a, 'py> {
    py: Python<'py>,
    numpy: &'static NumPy,
    dtypes: &'a [Option<(Bound<'py, PyAny>, usize)>],
    sources: [Option<Source<'py>>; 2],
}

impl<'a, 'py> Cutter<'a, 'py> {
    /// `mappings` and `dtypes` as [`views`] takes them.
    pub(super) fn new(
        py: Python<'py>,
        mappings: (Option<Bound<'py, PyAny>>, Option<Bound<'py, PyAny>>),
        dtypes: &'a [Option<(Bound<'py, PyAny>, usize)>],
    ) -> PyResult<Self> {
        Ok(Cutter {
            py,
            numpy: numpy(py)?,
            dtypes,
            sources: [Source::of(mappings.0)?, Source::of(mappings.1)?],
        })
    }

    /// The view of a (name, code, dims, stored) tuple, or None when Python should make it
    /// (any field not as a load gives it).
    fn view_of_entry(&self, entry: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let Some((code, place, dims, ndim)) = entry_parts(entry) else {
            return Ok(None);
        };
        self.view(code, place, &dims[..ndim])
    }

    /// The view of `code`'s values at `place` ((offset, nbytes, in the external data
    /// file?)) with C-order `dims`, or None when Python should make it: a type without a
    /// plain dtype, no bytes, bytes that are not the dims' worth, or a range outside its
    /// mapping.
    pub(super) fn view(
        &self,
        code: usize,
        place: (usize, usize, bool),
        dims: &[usize],
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        match self.planned(code, place, dims) {
            Some(plan) => plan.make(self.py, self.numpy).map(Some),
            None => Ok(None),
        }
    }

    fn planned(
        &self,
        code: usize,
        (offset, nbytes, external): (usize, usize, bool),
        dims: &[usize],
    ) -> Option<Plan<'_, 'py>> {
        let (dtype, itemsize) = self.dtypes.get(code)?.as_ref()?;
        let source = self.sources[usize::from(external)].as_ref()?;
        if nbytes == 0 || *itemsize == 0 || offset.checked_add(nbytes)? > source.len {
            return None;
        }
        let ndim = dims.len();
        if ndim > MAX_DIMS {
            return None;
        }
        let mut plan = Plan {
            dtype,
            ndim,
            dims: [0; MAX_DIMS],
            strides: [0; MAX_DIMS],
            // SAFETY: offset + nbytes <= len (checked above): inside the buffer.
            data: unsafe { source.start.add(offset) },
            source,
        };
        // C order: the last dim's items are adjacent; the dims must hold exactly nbytes.
        let mut step = *itemsize;
        for i in (0..ndim).rev() {
            plan.dims[i] = NpyIntp::try_from(dims[i]).ok()?;
            plan.strides[i] = NpyIntp::try_from(step).ok()?;
            step = step.checked_mul(dims[i])?;
        }
        (step == nbytes).then_some(plan)
    }
}

/// (code, (offset, nbytes, external), dims, ndim) of a (name, code, dims, stored) tuple as
/// a load gives it, or None for anything else (strings and nominal tensors included).
#[allow(clippy::type_complexity)]
fn entry_parts(
    entry: &Bound<'_, PyAny>,
) -> Option<(usize, (usize, usize, bool), [usize; MAX_DIMS], usize)> {
    let entry = entry.cast::<PyTuple>().ok()?;
    if entry.len() != 4 {
        return None;
    }
    let code: usize = entry.get_borrowed_item(1).ok()?.extract().ok()?;
    let place: (usize, usize, bool) = entry.get_borrowed_item(3).ok()?.extract().ok()?;
    let dims = entry.get_borrowed_item(2).ok()?;
    let dims = dims.cast::<PyTuple>().ok()?;
    let ndim = dims.len();
    if ndim > MAX_DIMS {
        return None;
    }
    let mut out = [0; MAX_DIMS];
    for (i, d) in out.iter_mut().enumerate().take(ndim) {
        *d = dims.get_borrowed_item(i).ok()?.extract().ok()?;
    }
    Some((code, place, out, ndim))
}

/// What one view needs: its dtype, shape, strides, first byte and base.
struct Plan<'a, 'py> {
    dtype: &'a Bound<'py, PyAny>,
    ndim: usize,
    dims: [NpyIntp; MAX_DIMS],
    strides: [NpyIntp; MAX_DIMS],
    data: *mut u8,
    source: &'a Source<'py>,
}

impl Plan<'_, '_> {
    fn make<'py>(self, py: Python<'py>, numpy: &NumPy) -> PyResult<Bound<'py, PyAny>> {
        let flags = if self.source.writable {
            NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_WRITEABLE
        } else {
            NPY_ARRAY_C_CONTIGUOUS
        };
        // SAFETY: NewFromDescr steals a reference to the dtype (hence the clone's into_ptr);
        // dims and strides have ndim entries; data..data+nbytes lies in the source's buffer,
        // which the base (set next) keeps alive and in place; NumPy computes the aligned
        // flag from the pointer and strides.
        let array = unsafe {
            (numpy.new_from_descr)(
                numpy.array_type,
                self.dtype.clone().into_ptr(),
                self.ndim as c_int,
                self.dims.as_ptr(),
                self.strides.as_ptr(),
                self.data.cast(),
                flags,
                std::ptr::null_mut(),
            )
        };
        // SAFETY: a new reference or null with an exception set.
        let array = unsafe { Bound::from_owned_ptr_or_err(py, array) }?;
        // SAFETY: `array` is a fresh ndarray without a base; SetBaseObject steals the
        // reference into_ptr gives it, on success and failure alike.
        let status =
            unsafe { (numpy.set_base_object)(array.as_ptr(), self.source.base.clone().into_ptr()) };
        if status < 0 {
            return Err(PyErr::fetch(py));
        }
        Ok(array)
    }
}
