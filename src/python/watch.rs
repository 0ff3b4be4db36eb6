//! `_core.watch_writes` and `_core.record_watched`: the page watch of `crate::untouched` for a
//! save of Python's arrays. Nothing of an array is kept between saves (no reference, not even a
//! weak one, which would stop `ndarray.resize`): memory freed and allocated again is the
//! kernel's to report (it reads as written: written by its new owner, zeroed pages given back,
//! or a new mapping, which is no longer watched), as `io::page_watch` checks at first use.

use pyo3::prelude::*;

use super::guarded;
use super::records::{payloads_in, CheckpointIn};
use crate::untouched;

/// What `watch_writes` armed for one save (nothing where the kernel offers no watch).
#[pyclass(frozen, module = "ortckpt._core")]
pub(super) struct Watched(Option<untouched::Armed>);

impl Watched {
    pub(super) fn armed(&self) -> Option<&untouched::Armed> {
        self.0.as_ref()
    }
}

/// Protects the pages of `checkpoint`'s values before a save of it to `path` reads them (see
/// `crate::untouched`).
#[pyfunction]
pub(super) fn watch_writes(
    py: Python<'_>,
    path: std::path::PathBuf,
    checkpoint: CheckpointIn<'_>,
) -> PyResult<Watched> {
    guarded(py, || {
        let mut buffers = Vec::new();
        let payloads = payloads_in(py, &path, checkpoint, &mut buffers)?;
        let armed = py.detach(|| {
            untouched::arm(payloads.tensors().filter_map(|t| match t.data {
                crate::format::Payload::Bytes(bytes) => Some(bytes),
                _ => None,
            }))
        });
        Ok(Watched(armed))
    })
}

/// After the save `watched` was armed for committed `path` (from `checkpoint`, the same state):
/// records where it keeps each watched value.
#[pyfunction]
pub(super) fn record_watched(
    py: Python<'_>,
    watched: PyRef<'_, Watched>,
    path: std::path::PathBuf,
    checkpoint: CheckpointIn<'_>,
) -> PyResult<()> {
    guarded(py, || {
        let Some(armed) = watched.armed() else {
            return Ok(());
        };
        let mut buffers = Vec::new();
        let payloads = payloads_in(py, &path, checkpoint, &mut buffers)?;
        py.detach(|| {
            let stored = crate::sharing::stored_origins(&path, &payloads);
            untouched::record(armed, stored.into_iter());
        });
        Ok(())
    })
}
