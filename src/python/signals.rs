//! A signal held across a commit, handed back to Python once the saving call has returned.

use pyo3::prelude::*;

/// Simulates the arrival of `signum` (Python's `PyErr_SetInterruptEx`) when it is freed: its
/// Python handler then runs at the interpreter's next check. Held as a local of the outermost
/// saving frame, it is freed as that frame returns, so a signal that came during the commit
/// surfaces in the caller, after a save that succeeded, never as an exception of that save.
#[pyclass(module = "ortckpt._core")]
pub struct SignalOnDrop {
    signum: i32,
}

#[pymethods]
impl SignalOnDrop {
    #[new]
    fn new(signum: i32) -> Self {
        Self { signum }
    }
}

impl Drop for SignalOnDrop {
    fn drop(&mut self) {
        // Async-signal-safe, needs no GIL, and only trips a flag: nothing runs here.
        unsafe {
            pyo3::ffi::PyErr_SetInterruptEx(self.signum);
        }
    }
}
