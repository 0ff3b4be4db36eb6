//! `_core.tensor_stats`, `_core.tensor_changes`, `_core.histogram`: the statistics kernels
//! ([`crate::compute::stats`]) over Python's buffers, with the GIL released for the whole pass.

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;

use super::{buffer_bytes, errors::to_py_err, guarded, mapped_input};
use crate::compute::stats::{self, Change, Figures, Tensor};
use crate::compute::Input;
use crate::format::DataType;

/// A tensor as Python hands it over: its ONNX type code, its values (a contiguous byte
/// buffer), and None or `(address, length)` of the mapping they lie in when its pages may be
/// dropped once read (a mapping the core made for this call's caller, nobody wrote through).
type TensorIn<'py> = (i32, Bound<'py, PyAny>, Option<(usize, usize)>);

/// `(nan, posinf, neginf, finite, min, max, mean, std, l2)`; the figures NaN without finite
/// values.
type FiguresOut = (u64, u64, u64, u64, f64, f64, f64, f64, f64);

/// `(changed, nonfinite, l2 of b - a, l2 of a, max abs difference, relative)`: relative is
/// the first l2 over the second, NaN when that is 0.
type ChangeOut = (u64, u64, f64, f64, f64, f64);

/// Bytes read between two calls of a progress callback: a checkpoint of 16,000 small
/// tensors does not take the GIL 16,000 times.
const REPORT_EVERY: u64 = 16 << 20;

/// A tensor's buffer, exported (so kept alive and unresizable) for the whole pass.
struct Held {
    data_type: DataType,
    buffer: PyBuffer<u8>,
    release: Option<std::ops::Range<usize>>,
}

impl Held {
    fn tensor(&self) -> Tensor<'_> {
        Tensor {
            data_type: self.data_type,
            input: Input {
                bytes: buffer_bytes(&self.buffer),
                release: self.release.clone(),
            },
        }
    }
}

fn held(py: Python<'_>, (code, values, release): TensorIn<'_>) -> PyResult<Held> {
    let data_type = DataType::from_code(code).map_err(|e| to_py_err(py, e))?;
    let (buffer, release) = mapped_input(py, &values, release, "statistics: a tensor's")?;
    Ok(Held {
        data_type,
        buffer,
        release,
    })
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

/// The statistics of every tensor, in order, in one pass over each (see [`FiguresOut`]).
/// `progress(nbytes)` is called (with the GIL) as values are read.
#[pyfunction]
#[pyo3(signature = (tensors, progress = None))]
pub fn tensor_stats(
    py: Python<'_>,
    tensors: Vec<TensorIn<'_>>,
    progress: Option<Py<PyAny>>,
) -> PyResult<Vec<FiguresOut>> {
    guarded(py, || {
        let held = tensors
            .into_iter()
            .map(|t| held(py, t))
            .collect::<PyResult<Vec<_>>>()?;
        let tensors: Vec<Tensor<'_>> = held.iter().map(Held::tensor).collect();
        let figures = with_progress(py, progress, |report| {
            stats::statistics(&tensors, threads(), report)
        })?;
        Ok(figures
            .into_iter()
            .map(|f: Figures| {
                (
                    f.nan, f.posinf, f.neginf, f.finite, f.min, f.max, f.mean, f.std, f.l2,
                )
            })
            .collect())
    })
}

/// The change figures of every pair `(a, b)` of same-typed, same-length tensors, in order
/// (see [`ChangeOut`]); `progress` as for [`tensor_stats`].
#[pyfunction]
#[pyo3(signature = (pairs, progress = None))]
pub fn tensor_changes(
    py: Python<'_>,
    pairs: Vec<(TensorIn<'_>, TensorIn<'_>)>,
    progress: Option<Py<PyAny>>,
) -> PyResult<Vec<ChangeOut>> {
    guarded(py, || {
        let held = pairs
            .into_iter()
            .map(|(a, b)| Ok((held(py, a)?, held(py, b)?)))
            .collect::<PyResult<Vec<_>>>()?;
        let pairs: Vec<_> = held.iter().map(|(a, b)| (a.tensor(), b.tensor())).collect();
        let changes = with_progress(py, progress, |report| {
            stats::changes(&pairs, threads(), report)
        })?;
        Ok(changes
            .into_iter()
            .map(|c: Change| {
                (
                    c.changed,
                    c.nonfinite,
                    c.l2,
                    c.norm_a,
                    c.max_abs,
                    c.relative,
                )
            })
            .collect())
    })
}

/// Counts of a tensor's finite values in the bins between `edges` (ascending, equally
/// spaced, as `numpy.histogram` makes them and counts).
#[pyfunction]
pub fn histogram(py: Python<'_>, tensor: TensorIn<'_>, edges: Vec<f64>) -> PyResult<Vec<u64>> {
    guarded(py, || {
        let held = held(py, tensor)?;
        let tensor = held.tensor();
        py.detach(|| stats::histogram(&tensor, &edges, threads()))
            .map_err(|e| to_py_err(py, e))
    })
}
