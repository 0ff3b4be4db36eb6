//! `MappedFile`: exports a loaded checkpoint's private mapping through the
//! buffer protocol, so `np.frombuffer` makes views that keep it alive via `.base`.

use std::ffi::c_int;

use memmap2::MmapMut;
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

/// The bytes of a loaded checkpoint, writable copy-on-write: writes through a
/// view change this process's copy (and so the next save), never the file.
#[pyclass(frozen, module = "ortckpt._core")]
pub struct MappedFile {
    base: BasePtr,
    len: usize,
    /// Owns the mapping `base` points into; unmapped when the last view goes.
    _map: MmapMut,
}

/// The mapping's first byte. The mapping never moves, so the address stays valid
/// as long as `_map` lives.
struct BasePtr(*mut u8);

// SAFETY: the pointer is only handed to Python's buffer protocol; the mapping it
// points into is owned by the same object and never remapped.
unsafe impl Send for BasePtr {}
// SAFETY: as above; concurrent writes through views are NumPy's usual data race
// semantics, the same as for any shared ndarray.
unsafe impl Sync for BasePtr {}

impl MappedFile {
    pub fn new(mut map: MmapMut) -> Self {
        MappedFile {
            base: BasePtr(map.as_mut_ptr()),
            len: map.len(),
            _map: map,
        }
    }
}

#[pymethods]
impl MappedFile {
    fn __len__(&self) -> usize {
        self.len
    }

    /// Drops this process's pages of `len` bytes at `offset` (whole pages inside the
    /// range), so that a pass over a large checkpoint keeps only what it is using in
    /// memory; later reads fault the bytes in again from the file. Private to ortckpt:
    /// only for mappings nobody wrote through, since it also drops this process's
    /// copy-on-write changes in the range.
    fn _release(&self, offset: usize, len: usize) -> PyResult<()> {
        let page = page_size();
        let start = offset.div_ceil(page) * page;
        let end = offset.saturating_add(len).min(self.len) / page * page;
        if end > start {
            // SAFETY: the range lies inside our mapping; MADV_DONTNEED on a private file
            // mapping only makes later reads fault the file's bytes in again.
            unsafe {
                self._map.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    start,
                    end - start,
                )
            }
            .map_err(|e| pyo3::exceptions::PyOSError::new_err(e.to_string()))?;
        }
        Ok(())
    }

    /// # Safety
    /// Called by Python with a valid `view` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("null Py_buffer"));
        }
        let this = slf.get();
        // SAFETY: base..base+len is our live mapping; FillInfo takes a reference to
        // `slf` (view.obj), which keeps the mapping alive while the view exists.
        let status = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                this.base.0.cast(),
                this.len as ffi::Py_ssize_t,
                0,
                flags,
            )
        };
        if status == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).unwrap_or(4096).max(1)
}
