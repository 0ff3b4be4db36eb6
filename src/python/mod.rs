//! The Python extension `ortckpt._core`: the only module that touches PyO3.
//!
//! Tensor bytes cross without copies in both directions: saving borrows each
//! array's buffer (held while the GIL is released for the write), loading hands
//! out one buffer over the private mapping that NumPy views slice.

mod errors;
mod mapped;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::Arc;

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::format::{
    Checkpoint, DataType, OptimizerGroup, ParameterOptimizerState, Payload, Stored, Tensor,
};
use crate::io::Progress;
use crate::SaveOptions;
use errors::to_py_err;
use mapped::MappedFile;

/// A tensor as Python hands it over: name, ONNX type code, dims, and its values
/// (an object with a contiguous byte buffer, a list of str, or None when nominal).
type TensorIn<'py> = (String, i32, Vec<i64>, Bound<'py, PyAny>);
/// An optimizer group: name, step, initial learning rate, [(param name, momentums)].
type GroupIn<'py> = (String, i64, f32, Vec<(String, Vec<TensorIn<'py>>)>);

/// Runs `f`, turning a panic into ortckpt.errors.InternalError: no panic crosses into Python.
fn guarded<T>(py: Python<'_>, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_owned());
        Err(errors::internal_error(py, &message))
    })
}

/// Opens a checkpoint: returns a dict of its metadata and a `MappedFile` whose
/// buffer holds the tensor bytes at the offsets given. Without `follow_symlinks`, a
/// symlink at the path (or at its data file) is refused.
#[pyfunction]
#[pyo3(signature = (path, *, follow_symlinks = true))]
fn load<'py>(
    py: Python<'py>,
    path: PathBuf,
    follow_symlinks: bool,
) -> PyResult<Bound<'py, PyDict>> {
    guarded(py, || {
        let loaded = py
            .detach(|| crate::load_with(&path, follow_symlinks))
            .map_err(|e| to_py_err(py, e))?;
        let (map, data, ckpt) = loaded.into_parts();
        let out = PyDict::new(py);
        out.set_item("mapping", Py::new(py, MappedFile::new(map))?)?;
        let external = data.map(|d| Py::new(py, MappedFile::new(d))).transpose()?;
        out.set_item("external_mapping", external)?;
        out.set_item("nominal", ckpt.is_nominal)?;
        out.set_item("trainable", tensors_out(py, &ckpt.trainable)?)?;
        out.set_item("frozen", tensors_out(py, &ckpt.frozen)?)?;
        let groups = PyList::empty(py);
        for g in &ckpt.optimizer_groups {
            let states = PyList::empty(py);
            for s in &g.states {
                states.append((s.param_name.as_str(), tensors_out(py, &s.momentums)?))?;
            }
            groups.append((g.name.as_str(), g.step, g.initial_learning_rate, states))?;
        }
        out.set_item("optimizer_groups", groups)?;
        out.set_item("ints", ckpt.properties.ints)?;
        out.set_item("floats", ckpt.properties.floats)?;
        out.set_item("strings", ckpt.properties.strings)?;
        Ok(out)
    })
}

fn tensors_out<'py>(py: Python<'py>, tensors: &[Tensor<Stored>]) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for t in tensors {
        let dims = PyTuple::new(py, &t.dims)?;
        // (offset, length, in the external data file?) | [str] | None (nominal)
        let data = match &t.data {
            Stored::Inline { offset, len } => (*offset as u64, *len as u64, false)
                .into_pyobject(py)?
                .into_any(),
            Stored::External { offset, len } => (*offset, *len, true).into_pyobject(py)?.into_any(),
            Stored::Strings(values) => values.into_pyobject(py)?.into_any(),
            Stored::Absent => py.None().into_bound(py),
        };
        list.append((t.name.as_str(), t.data_type.code(), dims, data))?;
    }
    Ok(list)
}

/// Saves a checkpoint (ONNX Runtime's state-path layout) atomically to `path`.
#[pyfunction]
#[pyo3(signature = (
    path, trainable, frozen, optimizer_groups, ints, floats, strings, *,
    nominal = false, durable = false, external_data_threshold = crate::DEFAULT_EXTERNAL_DATA_THRESHOLD,
    progress = None, keep_order = false,
))]
#[allow(clippy::too_many_arguments)]
fn save(
    py: Python<'_>,
    path: PathBuf,
    trainable: Vec<TensorIn<'_>>,
    frozen: Vec<TensorIn<'_>>,
    optimizer_groups: Vec<GroupIn<'_>>,
    ints: Vec<(String, i64)>,
    floats: Vec<(String, f32)>,
    strings: Vec<(String, String)>,
    nominal: bool,
    durable: bool,
    external_data_threshold: u64,
    progress: Option<PyRef<'_, SaveProgress>>,
    keep_order: bool,
) -> PyResult<()> {
    guarded(py, || {
        // Hold every buffer export until the write is done: the exports keep the
        // arrays' memory alive and unresizable while the GIL is released.
        let mut buffers = Vec::new();
        let mut ckpt = Checkpoint::<Intake> {
            trainable: tensors_in(py, trainable, &mut buffers, &path)?,
            frozen: tensors_in(py, frozen, &mut buffers, &path)?,
            is_nominal: nominal,
            ..Default::default()
        };
        for (name, step, initial_learning_rate, states) in optimizer_groups {
            let mut group = OptimizerGroup {
                name,
                step,
                initial_learning_rate,
                states: Vec::new(),
            };
            for (param_name, momentums) in states {
                let momentums = tensors_in(py, momentums, &mut buffers, &path)?;
                group.states.push(ParameterOptimizerState {
                    param_name,
                    momentums,
                });
            }
            ckpt.optimizer_groups.push(group);
        }
        ckpt.properties.ints = ints;
        ckpt.properties.floats = floats;
        ckpt.properties.strings = strings;

        let mut payloads = ckpt.try_map_data(|t| -> PyResult<Payload<'_>> {
            Ok(match &t.data {
                Intake::Buffer(i) => Payload::Bytes(buffer_bytes(&buffers[*i])),
                Intake::Strings(s) => Payload::Strings(s.clone()),
                Intake::Absent => Payload::Absent,
            })
        })?;
        let options = SaveOptions {
            durable,
            external_data_threshold,
            progress: progress.map(|p| Arc::clone(&p.0)),
            keep_order,
            ..SaveOptions::default()
        };
        py.detach(|| crate::save(&path, &mut payloads, &options))
            .map_err(|e| to_py_err(py, e))
    })
}

/// Bytes a running save has written, for a progress bar polling from another
/// Python thread (the save releases the GIL).
#[pyclass(frozen, module = "ortckpt._core")]
struct SaveProgress(Arc<Progress>);

#[pymethods]
impl SaveProgress {
    #[new]
    fn new() -> Self {
        SaveProgress(Arc::default())
    }

    /// Bytes the save will write in all (0 until it has encoded the checkpoint).
    #[getter]
    fn total(&self) -> u64 {
        self.0.total()
    }

    /// Bytes written so far.
    #[getter]
    fn written(&self) -> u64 {
        self.0.written()
    }
}

/// A tensor's values on their way in: an index into the held buffers, or owned strings.
enum Intake {
    Buffer(usize),
    Strings(Vec<String>),
    Absent,
}

fn tensors_in<'py>(
    py: Python<'py>,
    tensors: Vec<TensorIn<'py>>,
    buffers: &mut Vec<PyBuffer<u8>>,
    path: &std::path::Path,
) -> PyResult<Vec<Tensor<Intake>>> {
    let py_err = |e: crate::Error, name: &str| to_py_err(py, e.in_tensor(name).in_file(path));
    tensors
        .into_iter()
        .map(|(name, code, dims, values)| {
            let data_type = DataType::from_code(code).map_err(|e| py_err(e, &name))?;
            let data = if values.is_none() {
                Intake::Absent
            } else if let Ok(list) = values.cast::<PyList>() {
                Intake::Strings(list.extract()?)
            } else {
                let buffer = PyBuffer::<u8>::get(&values)?;
                if !buffer.is_c_contiguous() {
                    return Err(py_err(
                        crate::Error::invalid_state("values are not contiguous bytes"),
                        &name,
                    ));
                }
                buffers.push(buffer);
                Intake::Buffer(buffers.len() - 1)
            };
            Ok(Tensor {
                name,
                data_type,
                dims,
                data,
            })
        })
        .collect()
}

fn buffer_bytes(buffer: &PyBuffer<u8>) -> &[u8] {
    // SAFETY: the buffer is C-contiguous (checked on intake) and its export is held
    // for as long as the returned slice is used, so the memory stays valid.
    unsafe { std::slice::from_raw_parts(buffer.buf_ptr() as *const u8, buffer.len_bytes()) }
}

/// Panics on purpose, inside the same guard as `load` and `save` (with the GIL
/// released or held), so the test suite can prove that a panic arrives in Python
/// as ortckpt.errors.InternalError. Not part of the API.
#[pyfunction]
fn _panic_for_test(py: Python<'_>, message: String, release_gil: bool) -> PyResult<()> {
    guarded(py, || {
        if release_gil {
            py.detach(|| panic!("{message}"))
        } else {
            panic!("{message}")
        }
    })
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(load, m)?)?;
    m.add_function(wrap_pyfunction!(save, m)?)?;
    m.add_function(wrap_pyfunction!(_panic_for_test, m)?)?;
    m.add_class::<MappedFile>()?;
    m.add_class::<SaveProgress>()?;
    m.add("CHECKPOINT_VERSION", crate::format::CHECKPOINT_VERSION)?;
    m.add(
        "PAYLOAD_ALIGNMENT",
        crate::format::encode::PAYLOAD_ALIGNMENT,
    )?;
    m.add(
        "DEFAULT_EXTERNAL_DATA_THRESHOLD",
        crate::DEFAULT_EXTERNAL_DATA_THRESHOLD,
    )?;
    Ok(())
}
