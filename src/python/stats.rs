//! `_core.tensor_stats`, `_core.tensor_changes`, `_core.histogram`: the statistics kernels
//! ([`crate::compute::stats`]) over Python's buffers, with the GIL released for the whole pass.
//!
//! Tensors come as columns (a list of type codes, one of values, one of element counts), many
//! in one call: a checkpoint of 16,000 small tensors crosses the boundary once, and its
//! figures go back as columns too (lists of numbers, no object per tensor).

use pyo3::ffi;
use pyo3::prelude::*;

use super::{errors::to_py_err, guarded};
use crate::compute::stats::{self, Tensor};
use crate::compute::Input;
use crate::format::DataType;

/// Columns of figures: `(nan, posinf, neginf, finite, min, max, mean, std, l2)`, one entry a
/// tensor; the figures NaN without finite values.
type FiguresOut = (
    Vec<u64>,
    Vec<u64>,
    Vec<u64>,
    Vec<u64>,
    Vec<f64>,
    Vec<f64>,
    Vec<f64>,
    Vec<f64>,
    Vec<f64>,
);

/// Columns of change figures: `(changed, nonfinite, l2 of b - a, l2 of a, max abs difference,
/// relative)`: relative is the first l2 over the second, NaN when that is 0.
type ChangeOut = (Vec<u64>, Vec<u64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>);

/// Bytes read between two calls of a progress callback: a checkpoint of 16,000 small
/// tensors does not take the GIL 16,000 times.
const REPORT_EVERY: u64 = 16 << 20;

/// A tensor's values as Python hands them over: any C-contiguous buffer (a NumPy array of any
/// dtype: no format is asked for, so ml_dtypes' types are not refused), exported (so kept
/// alive and unresizable) for the whole pass.
struct Exported(Box<ffi::Py_buffer>);

impl Exported {
    fn get(values: &Bound<'_, PyAny>) -> PyResult<Self> {
        let mut view = Box::<ffi::Py_buffer>::new_uninit();
        // SAFETY: `view` is room for one Py_buffer, which the call fills on success.
        let rc = unsafe {
            ffi::PyObject_GetBuffer(values.as_ptr(), view.as_mut_ptr(), ffi::PyBUF_C_CONTIGUOUS)
        };
        if rc == -1 {
            return Err(PyErr::fetch(values.py()));
        }
        // SAFETY: filled by PyObject_GetBuffer, which succeeded.
        Ok(Exported(unsafe { view.assume_init() }))
    }

    fn bytes(&self) -> &[u8] {
        let len = usize::try_from(self.0.len).unwrap_or(0);
        if len == 0 || self.0.buf.is_null() {
            return &[];
        }
        // SAFETY: a C-contiguous export (asked for) of `len` bytes, held until this is dropped.
        unsafe { std::slice::from_raw_parts(self.0.buf as *const u8, len) }
    }
}

impl Drop for Exported {
    fn drop(&mut self) {
        // SAFETY: exported by PyObject_GetBuffer and released once, with the GIL.
        Python::attach(|_| unsafe { ffi::PyBuffer_Release(&mut *self.0) });
    }
}

/// One tensor of the columns, its buffer held for the pass.
struct Held {
    data_type: DataType,
    buffer: Exported,
    elements: Option<usize>,
    release: Option<std::ops::Range<usize>>,
}

impl Held {
    fn tensor(&self) -> Tensor<'_> {
        let input = Input {
            bytes: self.buffer.bytes(),
            release: self.release.clone(),
        };
        match self.elements {
            Some(elements) => Tensor {
                data_type: self.data_type,
                input,
                elements,
            },
            None => Tensor::whole(self.data_type, input),
        }
    }
}

/// The tensors of the columns `codes`, `values` and `elements` (None: as many as the bytes
/// hold, for a type of whole bytes). `maps`: `(address, length)` of the mappings whose pages
/// may be dropped once read (private file mappings the core made for this call's caller,
/// nobody wrote through): a tensor lying in one is read through it and its pages dropped.
fn held_columns(
    py: Python<'_>,
    codes: &[i32],
    values: &[Bound<'_, PyAny>],
    elements: &[Option<usize>],
    maps: &[(usize, usize)],
) -> PyResult<Vec<Held>> {
    if codes.len() != values.len() || elements.len() != values.len() {
        return Err(to_py_err(
            py,
            crate::Error::invalid_state(format!(
                "statistics: {} codes, {} values and {} element counts",
                codes.len(),
                values.len(),
                elements.len()
            )),
        ));
    }
    let maps: Vec<_> = maps
        .iter()
        .map(|&(address, len)| address..address.saturating_add(len))
        .collect();
    codes
        .iter()
        .zip(values)
        .zip(elements)
        .map(|((&code, values), &elements)| {
            let data_type = DataType::from_code(code).map_err(|e| to_py_err(py, e))?;
            let buffer = Exported::get(values)?;
            let bytes = buffer.bytes();
            let (start, end) = (
                bytes.as_ptr() as usize,
                bytes.as_ptr() as usize + bytes.len(),
            );
            let release = maps
                .iter()
                .find(|m| !bytes.is_empty() && m.start <= start && end <= m.end)
                .cloned();
            Ok(Held {
                data_type,
                buffer,
                elements,
                release,
            })
        })
        .collect()
}

/// Runs `pass` with the GIL released, telling `progress(nbytes)` (with the GIL) about every
/// [`REPORT_EVERY`] bytes read and the rest at the end; an exception from it stops the pass
/// and is raised.
fn with_progress<T: Send>(
    py: Python<'_>,
    progress: Option<Py<PyAny>>,
    pass: impl FnOnce(&mut (dyn FnMut(u64) -> crate::Result<()> + Send)) -> crate::Result<T> + Send,
) -> PyResult<T> {
    let mut raised: Option<PyErr> = None;
    let result = py.detach(|| {
        let mut pending = 0u64;
        let mut tell = |bytes: u64| -> crate::Result<()> {
            let Some(callback) = &progress else {
                return Ok(());
            };
            Python::attach(|py| callback.call1(py, (bytes,)).map(drop)).map_err(|e| {
                raised = Some(e);
                crate::Error::invalid_state("progress callback failed")
            })
        };
        let mut report = |bytes: u64| {
            pending += bytes;
            if pending < REPORT_EVERY {
                return Ok(());
            }
            tell(std::mem::take(&mut pending))
        };
        let result = pass(&mut report);
        if result.is_ok() && pending > 0 {
            tell(pending)?;
        }
        result
    });
    if let Some(e) = raised {
        return Err(e);
    }
    result.map_err(|e| to_py_err(py, e))
}

fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(8))
}

/// The statistics of every tensor of the columns (see [`held_columns`]), in order, in one
/// pass over each (see [`FiguresOut`]). `progress(nbytes)` is called (with the GIL) as
/// values are read.
#[pyfunction]
#[pyo3(signature = (codes, values, elements, maps = Vec::new(), progress = None))]
pub fn tensor_stats(
    py: Python<'_>,
    codes: Vec<i32>,
    values: Vec<Bound<'_, PyAny>>,
    elements: Vec<Option<usize>>,
    maps: Vec<(usize, usize)>,
    progress: Option<Py<PyAny>>,
) -> PyResult<FiguresOut> {
    guarded(py, || {
        let held = held_columns(py, &codes, &values, &elements, &maps)?;
        let tensors: Vec<Tensor<'_>> = held.iter().map(Held::tensor).collect();
        let figures = with_progress(py, progress, |report| {
            stats::statistics(&tensors, threads(), report)
        })?;
        let mut out: FiguresOut = Default::default();
        for f in figures {
            out.0.push(f.nan);
            out.1.push(f.posinf);
            out.2.push(f.neginf);
            out.3.push(f.finite);
            out.4.push(f.min);
            out.5.push(f.max);
            out.6.push(f.mean);
            out.7.push(f.std);
            out.8.push(f.l2);
        }
        Ok(out)
    })
}

/// The change figures from each tensor of `a` to the same one of `b` (same type and element
/// count: the columns `codes` and `elements` are of both), in order (see [`ChangeOut`]);
/// `maps` and `progress` as for [`tensor_stats`].
#[pyfunction]
#[pyo3(signature = (codes, a, b, elements, maps = Vec::new(), progress = None))]
pub fn tensor_changes(
    py: Python<'_>,
    codes: Vec<i32>,
    a: Vec<Bound<'_, PyAny>>,
    b: Vec<Bound<'_, PyAny>>,
    elements: Vec<Option<usize>>,
    maps: Vec<(usize, usize)>,
    progress: Option<Py<PyAny>>,
) -> PyResult<ChangeOut> {
    guarded(py, || {
        let held_a = held_columns(py, &codes, &a, &elements, &maps)?;
        let held_b = held_columns(py, &codes, &b, &elements, &maps)?;
        let pairs: Vec<_> = held_a
            .iter()
            .zip(&held_b)
            .map(|(a, b)| (a.tensor(), b.tensor()))
            .collect();
        let changes = with_progress(py, progress, |report| {
            stats::changes(&pairs, threads(), report)
        })?;
        let mut out: ChangeOut = Default::default();
        for c in changes {
            out.0.push(c.changed);
            out.1.push(c.nonfinite);
            out.2.push(c.l2);
            out.3.push(c.norm_a);
            out.4.push(c.max_abs);
            out.5.push(c.relative);
        }
        Ok(out)
    })
}

/// Counts of a tensor's finite values in the bins between `edges` (ascending, equally
/// spaced, as `numpy.histogram` makes them and counts); `code`, `values` and `elements` as
/// one entry of [`tensor_stats`]'s columns.
#[pyfunction]
pub fn histogram(
    py: Python<'_>,
    code: i32,
    values: Bound<'_, PyAny>,
    elements: Option<usize>,
    edges: Vec<f64>,
) -> PyResult<Vec<u64>> {
    guarded(py, || {
        let held = held_columns(py, &[code], &[values], &[elements], &[])?;
        let tensor = held[0].tensor();
        py.detach(|| stats::histogram(&tensor, &edges, threads()))
            .map_err(|e| to_py_err(py, e))
    })
}
