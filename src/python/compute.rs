//! `_core.combine`: the arithmetic kernels ([`crate::compute`]) over Python's buffers, with
//! the GIL released for the whole pass.

use std::fs::File;
use std::mem::ManuallyDrop;
use std::os::fd::FromRawFd;
use std::path::PathBuf;

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::{buffer_bytes, errors::to_py_err, guarded, mapped_input};
use crate::compute::{self, Input, Job, Operation, Sink};
use crate::format::DataType;

/// A combined tensor as Python hands it over: its ONNX type code, each source's values
/// (contiguous byte buffers, in source order), for each source None or `(address, length)`
/// of the mapping its values lie in when its pages may be dropped once used (a mapping the
/// core made for this call's caller, nobody wrote through), and where the result goes: a
/// writable buffer of the result's length, or `(fd, offset, path)` of a staged file.
type JobIn<'py> = (
    i32,
    Vec<Bound<'py, PyAny>>,
    Vec<Option<(usize, usize)>>,
    Bound<'py, PyAny>,
);

/// The first result that does not fit its type: `(job, element, exact value)`.
type OverflowOut = (usize, u64, f64);

/// A job's buffers, exported (and so kept alive and unresizable) for the whole pass.
struct Held {
    data_type: DataType,
    inputs: Vec<(PyBuffer<u8>, Option<std::ops::Range<usize>>)>,
    sink: HeldSink,
}

enum HeldSink {
    Memory(PyBuffer<u8>),
    /// The staged file's descriptor, owned by its `Staging` (never closed here).
    File(ManuallyDrop<File>, u64, PathBuf),
}

/// Computes `operation` ("average": coefficients the weights then their total; "delta": none;
/// "apply": the scale; "interpolate": `1 - t`, `t`) for every job, in order. Returns `(None,
/// sums)`: for each job the XXH3-64 checksum of the values written to its file (None for a
/// result in memory), or, at the first result that does not fit its type where every input is
/// finite, `((job, element, exact value), [])`: that job's result, and those after, are then
/// incomplete.
/// `progress(nbytes)` is called (with the GIL) after each result chunk is written.
#[pyfunction]
#[pyo3(signature = (operation, coefficients, jobs, progress = None))]
pub fn combine(
    py: Python<'_>,
    operation: &str,
    coefficients: Vec<f64>,
    jobs: Vec<JobIn<'_>>,
    progress: Option<Py<PyAny>>,
) -> PyResult<(Option<OverflowOut>, Vec<Option<u64>>)> {
    guarded(py, || {
        let operation = operation_of(operation, coefficients).map_err(|e| to_py_err(py, e))?;
        let held = jobs
            .into_iter()
            .map(|job| held(py, job))
            .collect::<PyResult<Vec<_>>>()?;
        let mut jobs: Vec<Job<'_>> = held.iter().map(job_of).collect();
        let mut raised: Option<PyErr> = None;
        let result = py.detach(|| {
            let mut report = |bytes: u64| -> crate::Result<()> {
                let Some(callback) = &progress else {
                    return Ok(());
                };
                Python::attach(|py| callback.call1(py, (bytes,)).map(drop)).map_err(|e| {
                    raised = Some(e);
                    crate::Error::invalid_state("progress callback failed")
                })
            };
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(4));
            compute::run(&operation, &mut jobs, threads, &mut report)
        });
        if let Some(e) = raised {
            return Err(e);
        }
        Ok(match result.map_err(|e| to_py_err(py, e))? {
            compute::Outcome::Written(sums) => (None, sums),
            compute::Outcome::Overflow(o) => (Some((o.job, o.element, o.exact)), Vec::new()),
        })
    })
}

fn operation_of(name: &str, coefficients: Vec<f64>) -> crate::Result<Operation> {
    let wrong = || {
        crate::Error::invalid_state(format!(
            "arithmetic: {name} with coefficients {coefficients:?}"
        ))
    };
    Ok(match (name, coefficients.as_slice()) {
        ("average", [weights @ .., total]) if !weights.is_empty() => Operation::Average {
            weights: weights.to_vec(),
            total: *total,
        },
        ("delta", []) => Operation::Delta,
        ("apply", [scale]) => Operation::Apply { scale: *scale },
        ("interpolate", [a, b]) => Operation::Interpolate { a: *a, b: *b },
        _ => return Err(wrong()),
    })
}

fn held(py: Python<'_>, (code, sources, release, sink): JobIn<'_>) -> PyResult<Held> {
    let data_type = DataType::from_code(code).map_err(|e| to_py_err(py, e))?;
    let invalid = |what: &str| to_py_err(py, crate::Error::invalid_state(what.to_owned()));
    if release.len() != sources.len() {
        return Err(invalid("arithmetic: one mapping (or None) a source"));
    }
    let mut inputs = Vec::with_capacity(sources.len());
    for (source, release) in sources.iter().zip(release) {
        let (buffer, release) = mapped_input(py, source, release, "arithmetic: a source's")?;
        inputs.push((buffer, release));
    }
    let sink = if let Ok(place) = sink.cast::<PyTuple>() {
        let (fd, offset, path): (i32, u64, PathBuf) = place.extract()?;
        // SAFETY: the descriptor is a staged file's, owned and kept open by its Staging for
        // the whole call (the caller holds it); ManuallyDrop never closes it.
        HeldSink::File(
            ManuallyDrop::new(unsafe { File::from_raw_fd(fd) }),
            offset,
            path,
        )
    } else {
        let buffer = PyBuffer::<u8>::get(&sink)?;
        if buffer.readonly() || !buffer.is_c_contiguous() {
            return Err(invalid(
                "arithmetic: the result's memory is not writable contiguous bytes",
            ));
        }
        HeldSink::Memory(buffer)
    };
    Ok(Held {
        data_type,
        inputs,
        sink,
    })
}

fn job_of(held: &Held) -> Job<'_> {
    let sink = match &held.sink {
        HeldSink::Memory(buffer) => {
            // SAFETY: a writable, C-contiguous export held for the whole pass; the caller
            // hands over memory of its own that nothing else reads or writes meanwhile.
            Sink::Memory(unsafe {
                std::slice::from_raw_parts_mut(buffer.buf_ptr().cast::<u8>(), buffer.len_bytes())
            })
        }
        HeldSink::File(file, offset, path) => Sink::File {
            file,
            offset: *offset,
            path,
        },
    };
    Job {
        data_type: held.data_type,
        inputs: held
            .inputs
            .iter()
            .map(|(buffer, release)| Input {
                bytes: buffer_bytes(buffer),
                release: release.clone(),
            })
            .collect(),
        sink,
    }
}
