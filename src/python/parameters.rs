//! `ParameterIndex`: a loaded checkpoint's parameters, kept as the core decoded them.
//!
//! A load used to hand Python one tuple per parameter ((name, code, dims, (offset, nbytes,
//! external))): five objects a tensor, made, walked by the garbage collector, read back by
//! `views`, and freed, for 16k small tensors more than a third of a load and pass. Now a
//! load gives Python this index and nothing per tensor; the state asks it for the names
//! (`positions`), one tensor's entry when that tensor is used (`entry`), or every view at
//! once (`views`, by position), which reads the decoded records directly.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySet, PyTuple};

use super::views::Cutter;
use crate::format::{Stored, Tensor};

/// The parameters of a loaded checkpoint: the trainable ones, then the frozen ones, in the
/// file's order; a parameter's position in this order is its index.
#[pyclass(frozen, module = "ortckpt._core")]
pub struct ParameterIndex {
    tensors: Vec<Tensor<Stored>>,
    trainable: usize,
}

impl ParameterIndex {
    pub fn new(trainable: Vec<Tensor<Stored>>, frozen: Vec<Tensor<Stored>>) -> Self {
        let count = trainable.len();
        let mut tensors = trainable;
        tensors.extend(frozen);
        ParameterIndex {
            tensors,
            trainable: count,
        }
    }

    fn at(&self, position: usize) -> PyResult<&Tensor<Stored>> {
        self.tensors
            .get(position)
            .ok_or_else(|| pyo3::exceptions::PyIndexError::new_err("no parameter at this position"))
    }
}

#[pymethods]
impl ParameterIndex {
    fn __len__(&self) -> usize {
        self.tensors.len()
    }

    /// How many of the parameters are trainable (they come first).
    #[getter]
    fn trainable_count(&self) -> usize {
        self.trainable
    }

    /// A new dict of every parameter's name to its position, in the file's order.
    fn positions<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for (i, t) in self.tensors.iter().enumerate() {
            out.set_item(t.name.as_str(), i)?;
        }
        Ok(out)
    }

    /// The names of the frozen parameters.
    fn frozen_names<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PySet>> {
        PySet::new(
            py,
            self.tensors[self.trainable..]
                .iter()
                .map(|t| t.name.as_str()),
        )
    }

    /// The parameter at `position` as (name, ONNX type code, dims, stored), `stored` being
    /// (offset, nbytes, in the external data file?), a list of str, or None (nominal).
    fn entry<'py>(&self, py: Python<'py>, position: usize) -> PyResult<Bound<'py, PyTuple>> {
        entry_of(py, self.at(position)?)
    }

    /// The entries ([`ParameterIndex::entry`]) of the positions from `start` to `stop`.
    fn entries<'py>(
        &self,
        py: Python<'py>,
        start: usize,
        stop: usize,
    ) -> PyResult<Bound<'py, PyList>> {
        let tensors = self.tensors.get(start..stop).unwrap_or_default();
        PyList::new(
            py,
            tensors
                .iter()
                .map(|t| entry_of(py, t))
                .collect::<PyResult<Vec<_>>>()?,
        )
    }

    /// The NumPy views of every parameter, by position, cut as `views` cuts them (`mappings`
    /// and `dtypes` as it takes them): a list with None for the parameters Python makes itself
    /// (strings, packed sub-byte types, empty or nominal tensors, a mapping that is no buffer).
    fn views<'py>(
        &self,
        py: Python<'py>,
        mappings: (Option<Bound<'py, PyAny>>, Option<Bound<'py, PyAny>>),
        dtypes: Vec<Option<(Bound<'py, PyAny>, usize)>>,
    ) -> PyResult<Bound<'py, PyList>> {
        super::guarded(py, || {
            let cutter = Cutter::new(py, mappings, &dtypes)?;
            let none = py.None().into_bound(py);
            let mut dims = Vec::new();
            let mut out = Vec::with_capacity(self.tensors.len());
            for t in &self.tensors {
                out.push(view_of(&cutter, t, &mut dims)?.unwrap_or_else(|| none.clone()));
            }
            PyList::new(py, out)
        })
    }
}

/// The view of `t`, or None where Python makes its value; `dims`: scratch space.
fn view_of<'py>(
    cutter: &Cutter<'_, 'py>,
    t: &Tensor<Stored>,
    dims: &mut Vec<usize>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let place = match t.data {
        Stored::Inline { offset, len } => (offset, len, false),
        Stored::External { offset, len } => match (usize::try_from(offset), usize::try_from(len)) {
            (Ok(offset), Ok(len)) => (offset, len, true),
            _ => return Ok(None),
        },
        Stored::Strings(_) | Stored::Absent => return Ok(None),
    };
    // (a negative dim: left to Python, which refuses it as before)
    dims.clear();
    dims.extend(t.dims.iter().map_while(|&d| usize::try_from(d).ok()));
    if dims.len() != t.dims.len() {
        return Ok(None);
    }
    let code = usize::try_from(t.data_type.code()).unwrap_or(usize::MAX);
    cutter.view(code, place, dims)
}

/// (name, code, dims, stored) of one tensor, untracked by the garbage collector when it
/// holds no list.
pub fn entry_of<'py>(py: Python<'py>, t: &Tensor<Stored>) -> PyResult<Bound<'py, PyTuple>> {
    let dims = super::untracked(PyTuple::new(py, &t.dims)?);
    // (offset, length, in the external data file?) | [str] | None (nominal)
    let (data, atomic) = match &t.data {
        Stored::Inline { offset, len } => {
            let place = (*offset as u64, *len as u64, false).into_pyobject(py)?;
            (super::untracked(place).into_any(), true)
        }
        Stored::External { offset, len } => (
            super::untracked((*offset, *len, true).into_pyobject(py)?).into_any(),
            true,
        ),
        Stored::Strings(values) => (values.into_pyobject(py)?.into_any(), false),
        Stored::Absent => (py.None().into_bound(py), true),
    };
    let entry = (t.name.as_str(), t.data_type.code(), dims, data).into_pyobject(py)?;
    Ok(if atomic {
        super::untracked(entry)
    } else {
        entry
    })
}
