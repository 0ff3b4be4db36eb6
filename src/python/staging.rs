//! The one commit of the core for files Python writes (`_core.stage`, `Staging`), directory
//! renames, and lock files (`_core.acquire_lock`, `Lock`).

use std::path::PathBuf;

use pyo3::prelude::*;

use super::errors::to_py_err;
use super::guarded;

/// Files being written that replace `target` (and `<target>.data` with `with_data`) only
/// when committed: the one commit of the core (`io::commit`), for files Python writes.
#[pyfunction]
#[pyo3(signature = (target, *, with_data = false))]
pub(super) fn stage(py: Python<'_>, target: PathBuf, with_data: bool) -> PyResult<Staging> {
    guarded(py, || {
        let staged = crate::io::Staged::new(&target, with_data).map_err(|e| to_py_err(py, e))?;
        Ok(Staging::of(staged))
    })
}

/// Drops the clean page cache of the file at `target` (never followed), which a staged save is
/// about to replace (`io::release_clean_cache`); false where nothing was done.
#[pyfunction]
pub(super) fn release_clean_cache(py: Python<'_>, target: PathBuf) -> bool {
    py.detach(|| crate::io::release_clean_cache(&target))
}

/// A staged file (and data file): written by Python through `fileno()`, published by
/// `commit()`, dropped by `discard()` (or when collected uncommitted).
#[pyclass(frozen, module = "ortckpt._core")]
pub(super) struct Staging(std::sync::Mutex<Option<crate::io::Staged>>);

impl Staging {
    pub(super) fn of(staged: crate::io::Staged) -> Self {
        Staging(std::sync::Mutex::new(Some(staged)))
    }

    fn with<T>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut crate::io::Staged) -> PyResult<T>,
    ) -> PyResult<T> {
        let mut guard = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match guard.as_mut() {
            Some(staged) => f(staged),
            None => Err(to_py_err(py, Staging::gone())),
        }
    }

    /// `f` of the staged checkpoint's file, or with `data` of its data file.
    fn with_file<T>(
        &self,
        py: Python<'_>,
        data: bool,
        f: impl FnOnce(&mut crate::io::PendingFile) -> T,
    ) -> PyResult<T> {
        self.with(py, |staged| {
            let file = if data {
                staged.data()
            } else {
                Some(staged.main())
            };
            let file = file.ok_or_else(|| {
                to_py_err(py, crate::Error::invalid_state("no data file is staged"))
            })?;
            Ok(f(file))
        })
    }

    fn gone() -> crate::Error {
        crate::Error::invalid_state("this staged save is committed or discarded")
    }
}

#[pymethods]
impl Staging {
    /// The file descriptor of the staged checkpoint (or, with `data`, of its data file):
    /// the core owns it; write with os.write/os.pwrite, never close it.
    #[pyo3(signature = (data = false))]
    fn fileno(&self, py: Python<'_>, data: bool) -> PyResult<i32> {
        use std::os::fd::AsRawFd;
        self.with_file(py, data, |file| file.file().as_raw_fd())
    }

    /// What the staged files replace when committed.
    #[getter]
    fn target(&self, py: Python<'_>) -> PyResult<PathBuf> {
        self.with(py, |staged| Ok(staged.target().to_path_buf()))
    }

    /// The temporary file's own (hidden, unpredictable) name, or its data file's with `data`.
    #[pyo3(signature = (data = false))]
    fn temporary(&self, py: Python<'_>, data: bool) -> PyResult<PathBuf> {
        self.with_file(py, data, |file| file.temp().to_path_buf())
    }

    /// Publishes the staged files (fsynced first with `durable`), waiting at most
    /// `lock_timeout` seconds for another save of the target to finish its commit. `unpaired`:
    /// files with no pair trailer (an ONNX model and its data), whose previous file is moved
    /// out of sight first (see `io::CommitOptions`).
    #[pyo3(signature = (*, durable = false, lock_timeout = None, unpaired = false))]
    fn commit(
        &self,
        py: Python<'_>,
        durable: bool,
        lock_timeout: Option<f64>,
        unpaired: bool,
    ) -> PyResult<()> {
        guarded(py, || {
            let staged = self.0.lock().unwrap_or_else(|p| p.into_inner()).take();
            let staged = staged.ok_or_else(|| to_py_err(py, Staging::gone()))?;
            let options = crate::io::CommitOptions {
                durable,
                lock_timeout: wait_or_default(py, lock_timeout)?,
                unpaired,
            };
            py.detach(|| staged.commit(&options))
                .map_err(|e| to_py_err(py, e))
        })
    }

    /// Writes the staged checkpoint's checksum block again after values were filled in place.
    /// `filled` None: every value is read and summed again. Else `(external, offset, sum)` of
    /// each tensor filled (in the data file or not, at that offset) with the XXH3-64 sum its
    /// filler took as it wrote, or None to read it; the other tensors keep the writer's sums.
    #[pyo3(signature = (filled = None))]
    fn reseal(
        &self,
        py: Python<'_>,
        filled: Option<Vec<(bool, u64, Option<u64>)>>,
    ) -> PyResult<()> {
        guarded(py, || {
            let filled: Option<Vec<crate::Filled>> = filled.map(|f| {
                f.into_iter()
                    .map(|(external, offset, sum)| crate::Filled {
                        external,
                        offset,
                        sum,
                    })
                    .collect()
            });
            self.with(py, |staged| {
                py.detach(|| crate::reseal(staged, filled.as_deref()))
                    .map_err(|e| to_py_err(py, e))
            })
        })
    }

    /// Seals files another writer (ONNX Runtime's saver) wrote whole into the staged files:
    /// the checksum block and pair trailers appended; a staged data file the checkpoint does
    /// not use is dropped. Then `commit()`.
    fn seal(&self, py: Python<'_>) -> PyResult<()> {
        guarded(py, || {
            self.with(py, |staged| {
                py.detach(|| crate::seal_written(staged))
                    .map_err(|e| to_py_err(py, e))
            })
        })
    }

    /// Removes the staged files; the target stays as it was.
    fn discard(&self) {
        let staged = self.0.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(staged);
    }
}

/// A caller's deadline in seconds (None: the default), checked: a negative or NaN one is a
/// CheckpointStateError, an infinite one a year.
pub(super) fn wait_or_default(
    py: Python<'_>,
    seconds: Option<f64>,
) -> PyResult<std::time::Duration> {
    seconds.map_or(Ok(crate::io::locks::DEFAULT_LOCK_TIMEOUT), |s| {
        crate::io::locks::wait_of(s).map_err(|e| to_py_err(py, e))
    })
}

/// Renames the directory `source` to `target`, which must not exist (FileExistsError if it
/// does), fsyncing both parents' entries with `durable`: how a step directory is committed
/// or retired.
#[pyfunction]
#[pyo3(signature = (source, target, *, durable = false))]
pub(super) fn rename_directory(
    py: Python<'_>,
    source: PathBuf,
    target: PathBuf,
    durable: bool,
) -> PyResult<()> {
    guarded(py, || {
        py.detach(|| crate::io::rename_directory(&source, &target, durable))
            .map_err(|e| to_py_err(py, e))
    })
}

/// An exclusive lock on the lock file `path` (mode 0600, this user's), taken within
/// `timeout` seconds (0: one try) or refused with CheckpointLockedError naming the holder;
/// `record` is written into it for whoever finds it held. None where the filesystem has
/// no locks.
#[pyfunction]
#[pyo3(signature = (path, *, timeout, record = String::new()))]
pub(super) fn acquire_lock(
    py: Python<'_>,
    path: PathBuf,
    timeout: f64,
    record: String,
) -> PyResult<Option<Lock>> {
    guarded(py, || {
        let timeout = crate::io::locks::wait_of(timeout).map_err(|e| to_py_err(py, e))?;
        let lock = py
            .detach(|| crate::io::LockFile::acquire_file(&path, timeout, &record))
            .map_err(|e| to_py_err(py, e))?;
        Ok(lock.map(|l| Lock(std::sync::Mutex::new(Some(l)))))
    })
}

/// A held lock (`acquire_lock`); `release()` removes its file and lets it go.
#[pyclass(frozen, module = "ortckpt._core")]
pub(super) struct Lock(std::sync::Mutex<Option<crate::io::LockFile>>);

#[pymethods]
impl Lock {
    fn release(&self) {
        let lock = self.0.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(lock);
    }

    #[getter]
    fn held(&self) -> bool {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }
}
