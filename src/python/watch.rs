//! `_core.watch_writes` and `_core.record_watched`: the page watch of `crate::untouched` for a
//! save of Python's arrays. Nothing of an array is kept between saves (no reference, not even a
//! weak one, which would stop `ndarray.resize`): memory freed and allocated again is the
//! kernel's to report (it reads as written: written by its new owner, zeroed pages given back,
//! or a new mapping, which is no longer watched), as `io::page_watch` checks at first use.

use pyo3::prelude::*;

use super::guarded;
use super::records::payloads_in;
use crate::untouched;

/// What `watch_writes` armed for one save (nothing where the kernel offers no watch).
#[pyclass(frozen, module = "ortckpt._core")]
pub(super) struct Watched(Option<untouched::Armed>);

impl Watched {
    pub(super) fn armed(&self) -> Option<&untouched::Armed> {
        self.0.as_ref()
    }
}

/// Protects the pages of `checkpoint`'s values (a `_CheckpointIn`) before a save of it to `path`
/// reads them (see `crate::untouched`). Its values are not even looked at while none is steady
/// (a model of small tensors, a run's first steps): only the comparison's findings are wanted.
#[pyfunction]
pub(super) fn watch_writes(
    py: Python<'_>,
    path: std::path::PathBuf,
    checkpoint: Bound<'_, PyAny>,
) -> PyResult<Watched> {
    guarded(py, || {
        if untouched::nothing_steady() {
            return Ok(Watched(py.detach(|| untouched::arm(std::iter::empty()))));
        }
        let mut buffers = Vec::new();
        let payloads = payloads_in(py, &path, checkpoint.extract()?, &mut buffers)?;
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
/// records where it keeps each watched value (nothing to do, nothing read, when none was).
#[pyfunction]
pub(super) fn record_watched(
    py: Python<'_>,
    watched: PyRef<'_, Watched>,
    path: std::path::PathBuf,
    checkpoint: Bound<'_, PyAny>,
) -> PyResult<()> {
    guarded(py, || {
        let Some(armed) = watched.armed().filter(|armed| !armed.is_empty()) else {
            return Ok(());
        };
        let mut buffers = Vec::new();
        let payloads = payloads_in(py, &path, checkpoint.extract()?, &mut buffers)?;
        py.detach(|| {
            let stored = crate::sharing::stored_origins(&path, &payloads);
            untouched::record(armed, stored.into_iter());
        });
        Ok(())
    })
}
