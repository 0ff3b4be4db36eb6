//! What Python hands over to save: a checkpoint's tensors, groups and properties, its
//! buffers exported and held (never copied) for as long as the save borrows them.

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::PyList;

use super::buffer_bytes;
use super::errors::to_py_err;
use crate::format::{
    Checkpoint, DataType, OptimizerGroup, ParameterOptimizerState, Payload, Tensor,
};

/// A tensor as Python hands it over: name, ONNX pub(super) type code, dims, and its values
/// (an object with a contiguous byte buffer, a list of str, or None when nominal).
pub(super) type TensorIn<'py> = (String, i32, Vec<i64>, Bound<'py, PyAny>);
/// The property bag: (ints, floats, strings).
pub(super) type PropertiesIn = (
    Vec<(String, i64)>,
    Vec<(String, f32)>,
    Vec<(String, String)>,
);
/// An optimizer group: name, step, initial learning rate, [(param name, momentums)].
pub(super) type GroupIn<'py> = (String, i64, f32, Vec<(String, Vec<TensorIn<'py>>)>);

/// The checkpoint Python hands over, its buffers exported into `buffers` and its values
/// borrowed from them, sorted as ONNX Runtime's saver orders it unless `keep_order`.
pub(super) fn payloads_in<'py, 'b>(
    py: Python<'py>,
    path: &std::path::Path,
    tensors: (Vec<TensorIn<'py>>, Vec<TensorIn<'py>>, Vec<GroupIn<'py>>),
    properties: PropertiesIn,
    (nominal, keep_order): (bool, bool),
    buffers: &'b mut Vec<PyBuffer<u8>>,
) -> PyResult<Checkpoint<Payload<'b>>> {
    let ckpt = checkpoint_in(py, path, tensors, properties, nominal, buffers)?;
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
    (trainable, frozen, optimizer_groups): (
        Vec<TensorIn<'py>>,
        Vec<TensorIn<'py>>,
        Vec<GroupIn<'py>>,
    ),
    (ints, floats, strings): PropertiesIn,
    nominal: bool,
    buffers: &mut Vec<PyBuffer<u8>>,
) -> PyResult<Checkpoint<Intake>> {
    let mut ckpt = Checkpoint::<Intake> {
        trainable: tensors_in(py, trainable, buffers, path)?,
        frozen: tensors_in(py, frozen, buffers, path)?,
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
