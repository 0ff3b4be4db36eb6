//! What Python hands over to write a checkpoint, as typed records read by attribute name, never
//! by position: [`CheckpointIn`] (an `ortckpt._boundary.CoreState`) and [`WriteOptionsIn`] (an
//! `ortckpt._boundary.WriteOptions`). Values are exported buffers, held (never copied) for as
//! long as the write borrows them.

use std::sync::Arc;

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::PyList;

use super::errors::to_py_err;
use super::staging::wait_or_default;
use super::{buffer_bytes, SaveProgress};
use crate::format::{
    Checkpoint, DataType, OptimizerGroup, ParameterOptimizerState, Payload, Tensor,
};
use crate::save::SaveOptions;

/// A tensor: `(name, ONNX type code, dims, values)`, the values an object with a contiguous
/// byte buffer, a list of str, or None when nominal. A plain tuple, as a load hands tensors out:
/// tens of thousands cross in one call, and a tuple is the cheapest object to make and read.
#[derive(FromPyObject)]
struct TensorIn<'py>(String, i32, Vec<i64>, Bound<'py, PyAny>);

/// A parameter's optimizer state: `(parameter name, [momentum tensor])`.
#[derive(FromPyObject)]
struct ParameterIn<'py>(String, Vec<TensorIn<'py>>);

/// An optimizer group: `(name, step, initial learning rate, [parameter state])`.
#[derive(FromPyObject)]
struct GroupIn<'py>(String, i64, f32, Vec<ParameterIn<'py>>);

/// A checkpoint to write: the attributes of `ortckpt._boundary.CoreState`.
#[derive(FromPyObject)]
pub(super) struct CheckpointIn<'py> {
    trainable: Vec<TensorIn<'py>>,
    frozen: Vec<TensorIn<'py>>,
    groups: Vec<GroupIn<'py>>,
    /// The property bag, by type.
    ints: Vec<(String, i64)>,
    floats: Vec<(String, f32)>,
    strings: Vec<(String, String)>,
    /// A nominal checkpoint: every tensor without values (ONNX Runtime's nominal state).
    nominal: bool,
    /// Tensors in the order given, not sorted as ONNX Runtime's state path sorts them.
    keep_order: bool,
}

impl<'py> CheckpointIn<'py> {
    /// Every tensor's values object, in the order given.
    pub(super) fn values(&self) -> impl Iterator<Item = &Bound<'py, PyAny>> {
        let momentums = self
            .groups
            .iter()
            .flat_map(|g| g.3.iter().flat_map(|p| p.1.iter()));
        self.trainable
            .iter()
            .chain(&self.frozen)
            .chain(momentums)
            .map(|t| &t.3)
    }
}

/// How to write a checkpoint's files: the attributes of `ortckpt._boundary.WriteOptions`.
#[derive(FromPyObject)]
pub(super) struct WriteOptionsIn<'py> {
    /// fsync the files and their directory before returning.
    durable: bool,
    /// Above this many bytes of values, they go to `<path>.data`.
    external_data_threshold: u64,
    /// Counts the bytes written, for a progress bar polling from another thread.
    progress: Option<PyRef<'py, SaveProgress>>,
    /// Seconds to wait for another save of the same path to commit (None: the default).
    lock_timeout: Option<f64>,
    /// Values, by the address of their buffer, left unwritten for the caller of a staged save
    /// to fill in place.
    holes: Vec<usize>,
}

impl WriteOptionsIn<'_> {
    /// The core's options. Its own sort is off: [`payloads_in`] sorted the intake in place.
    pub(super) fn save_options(self, py: Python<'_>) -> PyResult<SaveOptions> {
        Ok(SaveOptions {
            durable: self.durable,
            external_data_threshold: self.external_data_threshold,
            progress: self.progress.map(|p| Arc::clone(&p.0)),
            keep_order: true,
            lock_timeout: wait_or_default(py, self.lock_timeout)?,
            holes: self.holes.into_iter().collect(),
            ..SaveOptions::default()
        })
    }
}

/// The checkpoint Python hands over, its buffers exported into `buffers` and its values
/// borrowed from them, sorted as ONNX Runtime's saver orders it unless `keep_order`.
pub(super) fn payloads_in<'py, 'b>(
    py: Python<'py>,
    path: &std::path::Path,
    checkpoint: CheckpointIn<'py>,
    buffers: &'b mut Vec<PyBuffer<u8>>,
) -> PyResult<Checkpoint<Payload<'b>>> {
    let keep_order = checkpoint.keep_order;
    let ckpt = checkpoint_in(py, path, checkpoint, buffers)?;
    let buffers: &'b [PyBuffer<u8>] = buffers;
    Ok(sorted_unless(keep_order, payloads_of(&ckpt, buffers)?))
}

/// The checkpoint built for one call, sorted in place as ONNX Runtime's saver orders it (the
/// core's save would sort a copy, cloning every name, dims and string value) unless the caller
/// keeps its own order.
fn sorted_unless(
    keep_order: bool,
    mut payloads: Checkpoint<Payload<'_>>,
) -> Checkpoint<Payload<'_>> {
    if !keep_order {
        payloads.sort_like_ort_state_path();
    }
    payloads
}

/// The checkpoint Python hands over, its buffers exported into `buffers`.
fn checkpoint_in<'py>(
    py: Python<'py>,
    path: &std::path::Path,
    checkpoint: CheckpointIn<'py>,
    buffers: &mut Vec<PyBuffer<u8>>,
) -> PyResult<Checkpoint<Intake>> {
    let CheckpointIn {
        trainable,
        frozen,
        groups,
        ints,
        floats,
        strings,
        nominal,
        keep_order: _,
    } = checkpoint;
    let mut ckpt = Checkpoint::<Intake> {
        trainable: tensors_in(py, trainable, buffers, path)?,
        frozen: tensors_in(py, frozen, buffers, path)?,
        is_nominal: nominal,
        ..Default::default()
    };
    for GroupIn(name, step, initial_learning_rate, states) in groups {
        let mut group = OptimizerGroup {
            name,
            step,
            initial_learning_rate,
            states: Vec::new(),
        };
        for ParameterIn(param_name, momentums) in states {
            let momentums = tensors_in(py, momentums, buffers, path)?;
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
    Ok(ckpt)
}

/// The checkpoint with its values borrowed from the exported buffers.
fn payloads_of<'b>(
    ckpt: &Checkpoint<Intake>,
    buffers: &'b [PyBuffer<u8>],
) -> PyResult<Checkpoint<Payload<'b>>> {
    ckpt.try_map_data(|t| -> PyResult<Payload<'b>> {
        Ok(match &t.data {
            Intake::Buffer(i) => Payload::Bytes(buffer_bytes(&buffers[*i])),
            Intake::Strings(s) => Payload::Strings(s.clone()),
            Intake::Absent => Payload::Absent,
        })
    })
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
    let py_err =
        |e: crate::error::Error, name: &str| to_py_err(py, e.in_tensor(name).in_file(path));
    tensors
        .into_iter()
        .map(|TensorIn(name, code, dims, values)| {
            let data_type = DataType::from_code(code).map_err(|e| py_err(e, &name))?;
            let data = if values.is_none() {
                Intake::Absent
            } else if let Ok(list) = values.cast::<PyList>() {
                Intake::Strings(list.extract()?)
            } else {
                let buffer = PyBuffer::<u8>::get(&values)?;
                if !buffer.is_c_contiguous() {
                    return Err(py_err(
                        crate::error::Error::invalid_state("values are not contiguous bytes"),
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
