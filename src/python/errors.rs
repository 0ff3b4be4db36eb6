//! Rust errors -> Python exceptions. The exception classes live in
//! `ortckpt.errors` (Python), so the tree is defined once, where users read it.

use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;

use crate::error::{Error, ErrorKind};

/// The Python exception for `e`: OS errors become OSError subclasses (errno picks
/// FileNotFoundError etc.) with `filename`; the rest come from ortckpt.errors with
/// `filename` and `tensor` attributes.
pub fn to_py_err(py: Python<'_>, e: Error) -> PyErr {
    let filename = e.path().map(|p| p.to_string_lossy().into_owned());
    let class = match e.kind() {
        ErrorKind::Io(io) => {
            return match io.raw_os_error() {
                // Python builds "[Errno N] strerror: 'filename'" and picks the subclass from errno.
                Some(errno) => {
                    let full = io.to_string();
                    let strerror = full
                        .strip_suffix(&format!(" (os error {errno})"))
                        .unwrap_or(&full);
                    PyOSError::new_err((errno, strerror.to_owned(), filename))
                }
                None => PyOSError::new_err(format!("{e}")),
            };
        }
        ErrorKind::Integrity(_) => {
            // CheckpointIntegrityError lists problems, each naming its file.
            let build = || -> PyResult<PyErr> {
                let class = py
                    .import("ortckpt.errors")?
                    .getattr("CheckpointIntegrityError")?;
                let path = filename.clone().unwrap_or_default();
                let problem = e.to_string();
                let instance = class.call1((path, vec![problem]))?;
                instance.setattr("tensor", e.tensor())?;
                Ok(PyErr::from_value(instance))
            };
            return build().unwrap_or_else(|import_failure| import_failure);
        }
        ErrorKind::Malformed(_) => "CheckpointFormatError",
        ErrorKind::UnsupportedDataType(_) => "UnsupportedDataTypeError",
        ErrorKind::InvalidState(_) => "CheckpointStateError",
        ErrorKind::BigEndianHost => "UnsupportedPlatformError",
        ErrorKind::NotRegularFile(_) => "SpecialFileError",
        ErrorKind::Locked { holder, .. } => {
            let err = package_error(py, "CheckpointLockedError", &e.to_string(), filename, None);
            let _ = err.value(py).setattr("holder", holder.as_str());
            return err;
        }
    };
    package_error(py, class, &e.to_string(), filename, e.tensor())
}

pub fn internal_error(py: Python<'_>, message: &str) -> PyErr {
    package_error(
        py,
        "InternalError",
        &format!("internal error in ortckpt (please report): {message}"),
        None,
        None,
    )
}

fn package_error(
    py: Python<'_>,
    class: &str,
    message: &str,
    filename: Option<String>,
    tensor: Option<&str>,
) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let class = py.import("ortckpt.errors")?.getattr(class)?;
        let instance = class.call1((message,))?;
        instance.setattr("filename", filename)?;
        instance.setattr("tensor", tensor)?;
        Ok(PyErr::from_value(instance))
    };
    build().unwrap_or_else(|import_failure| import_failure)
}
