//! ONNX Runtime's saver given a buffer that grows in place, in a forked child
//! (`io::in_place`): planned in the parent, installed in the child.

use pyo3::prelude::*;

use crate::io::in_place;

/// Where ONNX Runtime's library calls `operator new[]` and `operator delete[]`.
#[pyclass(frozen, module = "ortckpt._core")]
pub(super) struct InPlacePlan(in_place::Plan);

/// The plan for the loaded library whose file name contains `library`, or None (not loaded
/// once, or not a library whose slots can be planned).
#[pyfunction]
pub(super) fn in_place_plan(library: &str) -> Option<InPlacePlan> {
    in_place::plan(library).map(InPlacePlan)
}

/// Installs `plan` in this process: only in a forked child that runs one ONNX Runtime save
/// and exits. True once installed.
#[pyfunction]
pub(super) fn grow_in_place(plan: &InPlacePlan) -> bool {
    // SAFETY: the caller (ortckpt.forked_save's child) runs ONNX Runtime's saver once, on
    // this one thread, then exits; the plan was made in the address space it forked from.
    unsafe { in_place::install(&plan.0) }
}

/// Bytes the saver's buffer took in place in this process.
#[pyfunction]
pub(super) fn placed_in_place() -> u64 {
    in_place::placed()
}
