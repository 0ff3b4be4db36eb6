//! The Python extension `ortckpt._core`: the only module that touches PyO3.
//!
//! Tensor bytes cross without copies in both directions: saving borrows each
//! array's buffer (held while the GIL is released for the write), loading hands
//! out one buffer over the private mapping that NumPy views slice (all of them in one
//! call: `views`).

mod compute;
mod errors;
mod in_place;
mod mapped;
mod parameters;
mod records;
mod signals;
mod staging;
mod stats;
mod views;
mod watch;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::Arc;

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use crate::format::{Checkpoint, Stored, Tensor};
use crate::io::Progress;
use errors::to_py_err;
use mapped::MappedFile;
use records::{payloads_in, CheckpointIn, WriteOptionsIn};
use staging::{acquire_lock, release_clean_cache, rename_directory, stage, Lock, Staging};

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
/// symlink at the path (or at its data file) is refused. With `verify`, every byte is
/// first checked against the file's checksums (CheckpointIntegrityError if one differs),
/// and the dict's "checksums" says whether it had any.
#[pyfunction]
#[pyo3(signature = (path, *, follow_symlinks = true, verify = false))]
fn load<'py>(
    py: Python<'py>,
    path: PathBuf,
    follow_symlinks: bool,
    verify: bool,
) -> PyResult<Bound<'py, PyDict>> {
    guarded(py, || {
        let (loaded, checked) = py
            .detach(|| {
                let loaded = crate::load_with(&path, follow_symlinks)?;
                let checked = if verify {
                    Some(loaded.verify_checksums()?)
                } else {
                    None
                };
                Ok((loaded, checked))
            })
            .map_err(|e| to_py_err(py, e))?;
        let checksums = checked.map(|c| matches!(c, crate::Checked::Verified { .. }));
        let (map, data, ckpt) = loaded.into_parts();
        let mapping = Py::new(py, MappedFile::new(map))?.into_any();
        let external = data
            .map(|d| Py::new(py, MappedFile::new(d)))
            .transpose()?
            .map(Py::into_any);
        let out = described(py, ckpt, mapping, external)?;
        out.set_item("checksums", checksums)?;
        Ok(out)
    })
}

/// Checks the checkpoint at `path` against its checksums, reading every value once with the
/// GIL released: (tensors, bytes of values, root checksum), or None when the file has no
/// checksums (ONNX Runtime's own, an older ortckpt's). CheckpointIntegrityError names the file
/// and tensor that differ.
#[pyfunction]
#[pyo3(signature = (path, *, follow_symlinks = true))]
fn verify_checksums(
    py: Python<'_>,
    path: PathBuf,
    follow_symlinks: bool,
) -> PyResult<Option<(usize, u64, u64)>> {
    guarded(py, || {
        let checked = py
            .detach(|| crate::load_with(&path, follow_symlinks)?.verify_checksums())
            .map_err(|e| to_py_err(py, e))?;
        Ok(match checked {
            crate::Checked::NoChecksums => None,
            crate::Checked::Verified {
                tensors,
                bytes,
                root,
            } => Some((tensors, bytes, root)),
        })
    })
}

/// (size, root checksum) of the checkpoint file at `path` (its last bytes only), the root
/// None when it has no checksums. Without `follow_symlinks`, a symlink is refused.
#[pyfunction]
#[pyo3(signature = (path, *, follow_symlinks = true))]
fn checksum_root(
    py: Python<'_>,
    path: PathBuf,
    follow_symlinks: bool,
) -> PyResult<(u64, Option<u64>)> {
    guarded(py, || {
        py.detach(|| crate::checksum_root_of_file(&path, follow_symlinks))
            .map_err(|e| to_py_err(py, e))
    })
}

/// Decodes a checkpoint held in a Python buffer (bytes, bytearray, memoryview, mmap...)
/// without copying: the dict is `load`'s, its "mapping" the object given, whose bytes
/// the offsets index. A checkpoint with external data needs `external`, the object its
/// external offsets index (handed back as "external_mapping", never read here), with
/// `external_len`, the data file's length, and `external_tail`, its last bytes (32, or all
/// of a shorter file), which the checks read.
#[pyfunction]
#[pyo3(signature = (data, *, external = None, external_len = 0, external_tail = None))]
fn load_buffer<'py>(
    py: Python<'py>,
    data: Bound<'py, PyAny>,
    external: Option<Bound<'py, PyAny>>,
    external_len: u64,
    external_tail: Option<Vec<u8>>,
) -> PyResult<Bound<'py, PyDict>> {
    guarded(py, || {
        let buffer = PyBuffer::<u8>::get(&data)?;
        if !buffer.is_c_contiguous() {
            return Err(to_py_err(
                py,
                crate::Error::invalid_state("the buffer is not contiguous bytes"),
            ));
        }
        let paired = external
            .as_ref()
            .map(|_| (external_len, external_tail.as_deref().unwrap_or_default()));
        // Decoded with the GIL held, though nothing relies on it: another process may
        // write a shared mmap meanwhile, and the decoder checks every read as it makes it.
        let ckpt = crate::decode_buffer_paired(buffer_bytes(&buffer), paired)
            .map_err(|e| to_py_err(py, e))?;
        described(py, ckpt, data.unbind(), external.map(Bound::unbind))
    })
}

/// The dict `load` returns: the mappings, the metadata, the parameters as a
/// [`parameters::ParameterIndex`] (nothing made per parameter until asked), and every
/// momentum as (name, code, dims, stored) where stored indexes the mappings.
fn described<'py>(
    py: Python<'py>,
    ckpt: Checkpoint<Stored>,
    mapping: Py<PyAny>,
    external: Option<Py<PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("mapping", mapping)?;
    out.set_item("external_mapping", external)?;
    out.set_item("version", ckpt.version)?;
    out.set_item("nominal", ckpt.is_nominal)?;
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
    let index = parameters::ParameterIndex::new(ckpt.trainable, ckpt.frozen);
    out.set_item("parameters", Py::new(py, index)?)?;
    Ok(out)
}

fn tensors_out<'py>(py: Python<'py>, tensors: &[Tensor<Stored>]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(
        py,
        tensors
            .iter()
            .map(|t| parameters::entry_of(py, t))
            .collect::<PyResult<Vec<_>>>()?,
    )
}

/// `tuple`, no longer tracked by the cyclic garbage collector: for tuples of str, ints and
/// such tuples, which cannot be part of a cycle. CPython untracks these itself, but only
/// when a collection first walks them; a load of 16k tensors makes about 50k, and walking
/// them was a fifth of the load's time (and of the first pass's, when they set off a full
/// collection there).
fn untracked(tuple: Bound<'_, PyTuple>) -> Bound<'_, PyTuple> {
    // SAFETY: a tuple is a GC object; untracking one that holds no mutable container only
    // spares the collector a walk (it is what CPython's own tuple untracking does).
    unsafe { pyo3::ffi::PyObject_GC_UnTrack(tuple.as_ptr().cast()) };
    tuple
}

/// Saves a checkpoint (ONNX Runtime's state-path layout) atomically to `path`.
#[pyfunction]
fn save(
    py: Python<'_>,
    path: PathBuf,
    checkpoint: CheckpointIn<'_>,
    options: WriteOptionsIn<'_>,
) -> PyResult<()> {
    guarded(py, || {
        // Hold every buffer export until the write is done: the exports keep the
        // arrays' memory alive and unresizable while the GIL is released.
        let mut buffers = Vec::new();
        let payloads = payloads_in(py, &path, checkpoint, &mut buffers)?;
        let options = options.save_options(py)?;
        py.detach(|| crate::save(&path, &payloads, &options))
            .map_err(|e| to_py_err(py, e))
    })
}

/// `save` written, not committed: the staged files, and where each tensor's values are in them
/// ((address of its buffer, offset, in the data file?)), for the caller to fill values in place
/// (the `holes` of `options`), then commit.
#[pyfunction]
fn save_staged(
    py: Python<'_>,
    path: PathBuf,
    checkpoint: CheckpointIn<'_>,
    options: WriteOptionsIn<'_>,
) -> PyResult<(Staging, crate::save::PlacedValues)> {
    guarded(py, || {
        let mut buffers = Vec::new();
        let payloads = payloads_in(py, &path, checkpoint, &mut buffers)?;
        let options = options.save_options(py)?;
        let (staged, placed) = py
            .detach(|| crate::save::write_staged(&path, &payloads, &options))
            .map_err(|e| to_py_err(py, e))?;
        Ok((Staging::of(staged), placed))
    })
}

/// Saves a checkpoint at the new `path` sharing, with the checkpoint at `previous`, the data
/// file whose bytes it still holds unchanged (see `crate::sharing`): (whether it did, else
/// nothing was written and the caller saves whole; bytes of values unchanged since `previous`,
/// wherever kept; bytes of values in all; bytes of values compared byte for byte).
/// `compare_only`: never writes, only counts. `watched`: what `watch_writes` armed for this
/// checkpoint (its values proven unwritten are not compared). Of `options`, the threshold and
/// holes play no part: sharing decides where values go.
#[pyfunction]
#[pyo3(signature = (path, previous, checkpoint, options, *, compare_only = false, watched = None))]
fn save_sharing(
    py: Python<'_>,
    path: PathBuf,
    previous: PathBuf,
    checkpoint: CheckpointIn<'_>,
    options: WriteOptionsIn<'_>,
    compare_only: bool,
    watched: Option<PyRef<'_, watch::Watched>>,
) -> PyResult<(bool, u64, u64, u64)> {
    guarded(py, || {
        let mut buffers = Vec::new();
        let payloads = payloads_in(py, &path, checkpoint, &mut buffers)?;
        let options = options.save_options(py)?;
        let armed = watched.as_ref().and_then(|w| w.armed());
        let sharing = py
            .detach(|| {
                crate::sharing::save_sharing(
                    &path,
                    &payloads,
                    &previous,
                    compare_only,
                    armed,
                    &options,
                )
            })
            .map_err(|e| to_py_err(py, e))?;
        Ok((
            sharing.shared,
            sharing.unchanged,
            sharing.values,
            sharing.compared,
        ))
    })
}

/// Where the bytes of `data` (a contiguous buffer) are the current bytes of a file, proven
/// (see `crate::io::FileBacked`): (st_dev, st_ino, offset of its first byte in the file), or
/// None where nothing proves it.
#[pyfunction]
fn file_span(py: Python<'_>, data: Bound<'_, PyAny>) -> PyResult<Option<(u64, u64, u64)>> {
    guarded(py, || {
        let buffer = PyBuffer::<u8>::get(&data)?;
        if !buffer.is_c_contiguous() {
            return Err(to_py_err(
                py,
                crate::Error::invalid_state("the buffer is not contiguous bytes"),
            ));
        }
        let bytes = buffer_bytes(&buffer);
        let span = crate::io::FileBacked::read().and_then(|backed| backed.span(bytes));
        Ok(span.map(|(file, offset)| {
            let (dev, ino) = file.dev_and_inode();
            (dev, ino, offset)
        }))
    })
}

/// Encodes a checkpoint into a new `bytes`: each tensor's bytes are copied once, from its
/// array into the result.
#[pyfunction]
fn save_bytes<'py>(
    py: Python<'py>,
    checkpoint: CheckpointIn<'py>,
) -> PyResult<Bound<'py, PyBytes>> {
    guarded(py, || {
        let mut buffers = Vec::new();
        let payloads = payloads_in(
            py,
            std::path::Path::new("<bytes>"),
            checkpoint,
            &mut buffers,
        )?;
        let encoded = crate::encode_in_memory(&payloads, true).map_err(|e| to_py_err(py, e))?;
        let segments = encoded.segments();
        let len = segments.iter().map(|s| s.len()).sum();
        PyBytes::new_with(py, len, |out| {
            let mut at = 0;
            for segment in &segments {
                out[at..at + segment.len()].copy_from_slice(segment);
                at += segment.len();
            }
            Ok(())
        })
    })
}

/// A stream's segment as a Python object: the very object a tensor's values were handed over
/// as, found by its exported buffer's address and length (tensor bytes are never copied), or
/// `bytes` copied out of the encoder (the metadata).
fn segment_objects<'py, 'a>(
    py: Python<'py>,
    owners: &'a [Bound<'py, PyAny>],
) -> impl Fn(&[u8]) -> Bound<'py, PyAny> + 'a {
    let by_address: std::collections::HashMap<(usize, usize), &Bound<'py, PyAny>> = owners
        .iter()
        .filter_map(|owner| {
            let buffer = PyBuffer::<u8>::get(owner).ok()?;
            Some(((buffer.buf_ptr() as usize, buffer.len_bytes()), owner))
        })
        .collect();
    move |bytes: &[u8]| match by_address.get(&(bytes.as_ptr() as usize, bytes.len())) {
        Some(owner) => (*owner).clone(),
        None => PyBytes::new(py, bytes).into_any(),
    }
}

/// Encodes a checkpoint for writing as a stream: returns (checkpoint file, external data) where
/// the checkpoint file is its segments in order, and the external data None or (its length,
/// [(offset, segment)]), zeros between. A segment is `bytes` (the metadata, copied out of the
/// encoder) or the very object a tensor's values were handed over as: tensor bytes are never
/// copied here.
#[pyfunction]
#[pyo3(signature = (checkpoint, *, external_data_threshold = crate::DEFAULT_EXTERNAL_DATA_THRESHOLD))]
fn encode_segments<'py>(
    py: Python<'py>,
    checkpoint: CheckpointIn<'py>,
    external_data_threshold: u64,
) -> PyResult<Bound<'py, PyTuple>> {
    guarded(py, || {
        let owners: Vec<Bound<'py, PyAny>> = checkpoint.values().cloned().collect();
        let mut buffers = Vec::new();
        let payloads = payloads_in(
            py,
            std::path::Path::new("<stream>"),
            checkpoint,
            &mut buffers,
        )?;
        let mut encoded = crate::encode_for_stream(&payloads, true, external_data_threshold)
            .map_err(|e| to_py_err(py, e))?;
        // The stream's consumer writes the values: they are summed here, from memory, first.
        py.detach(|| encoded.seal_from_memory());
        let segment = segment_objects(py, &owners);
        let main = PyList::empty(py);
        for bytes in encoded.segments() {
            main.append(segment(bytes))?;
        }
        let external = if encoded.has_external_data() {
            let (len, parts) = encoded.external_data();
            let list = PyList::empty(py);
            for (offset, bytes) in parts {
                list.append((offset, segment(bytes)))?;
            }
            (len, list).into_pyobject(py)?.into_any()
        } else {
            py.None().into_bound(py)
        };
        PyTuple::new(py, [main.into_any(), external])
    })
}

/// Encodes a checkpoint for streaming that shares an existing data file (the one whose pair id
/// is `pair_id`): each tensor whose buffer, by (address, length), is a key of `shared` is
/// external at that offset there, every other value inline. Returns the checkpoint file's
/// segments in order, as [`encode_segments`] does (no data file is written: it exists). The
/// caller vouches that the shared bytes equal its own (the checksums are summed from them):
/// an object store's writer proves it by their SHA-256s. A checkpoint whose inline values
/// would pass ONNX Runtime's 2 GiB is an error (saved whole instead).
#[pyfunction]
fn encode_sharing_segments<'py>(
    py: Python<'py>,
    checkpoint: CheckpointIn<'py>,
    pair_id: [u8; 16],
    shared: std::collections::HashMap<(usize, usize), u64>,
) -> PyResult<Bound<'py, PyList>> {
    guarded(py, || {
        let owners: Vec<Bound<'py, PyAny>> = checkpoint.values().cloned().collect();
        let mut buffers = Vec::new();
        let payloads = payloads_in(
            py,
            std::path::Path::new("<stream>"),
            checkpoint,
            &mut buffers,
        )?;
        crate::format::endian::ensure_host_little_endian().map_err(|e| to_py_err(py, e))?;
        let offsets: Vec<Option<u64>> = payloads
            .tensors()
            .map(|t| match t.data {
                crate::format::Payload::Bytes(bytes)
                    if bytes.len() >= crate::format::encode::EXTERNAL_MIN_BYTES =>
                {
                    shared.get(&(bytes.as_ptr() as usize, bytes.len())).copied()
                }
                _ => None,
            })
            .collect();
        // No known sums: each shared value is summed from the caller's (equal) bytes.
        let sums = vec![None; offsets.len()];
        let mut encoded =
            crate::format::encode::encode_sharing(&payloads, &pair_id, &offsets, &sums)
                .map_err(|e| to_py_err(py, e))?;
        py.detach(|| encoded.seal_from_memory());
        let segment = segment_objects(py, &owners);
        let main = PyList::empty(py);
        for bytes in encoded.segments() {
            main.append(segment(bytes))?;
        }
        Ok(main)
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

/// A kernel's input as Python hands it over: its values (a C-contiguous buffer, exported and so
/// held for the call) and, when its pages may be dropped once used, `(address, length)` of the
/// mapping they lie in, checked to hold them. `what` names the input in errors ("arithmetic: a
/// source's").
fn mapped_input(
    py: Python<'_>,
    values: &Bound<'_, PyAny>,
    release: Option<(usize, usize)>,
    what: &str,
) -> PyResult<(PyBuffer<u8>, Option<std::ops::Range<usize>>)> {
    let invalid =
        |problem: &str| to_py_err(py, crate::Error::invalid_state(format!("{what} {problem}")));
    let buffer = PyBuffer::<u8>::get(values)?;
    if !buffer.is_c_contiguous() {
        return Err(invalid("values are not contiguous"));
    }
    let release = release.map(|(address, len)| address..address.saturating_add(len));
    let (start, len) = (buffer.buf_ptr() as usize, buffer.len_bytes());
    if release
        .as_ref()
        .is_some_and(|r| start < r.start || start + len > r.end)
    {
        return Err(invalid("values lie outside its mapping"));
    }
    Ok((buffer, release))
}

fn buffer_bytes(buffer: &PyBuffer<u8>) -> &[u8] {
    // SAFETY: the buffer is C-contiguous (checked on intake) and its export is held
    // for as long as the returned slice is used, so the memory stays valid.
    unsafe { std::slice::from_raw_parts(buffer.buf_ptr() as *const u8, buffer.len_bytes()) }
}

/// Panics on purpose, inside the same guard as `load` and `save` (with the GIL
/// released or held), so the test suite can prove that a panic arrives in Python
/// as ortckpt.errors.InternalError. Not part of the API, and not in the wheel.
#[cfg(feature = "test-hooks")]
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
    m.add_function(wrap_pyfunction!(verify_checksums, m)?)?;
    m.add_function(wrap_pyfunction!(checksum_root, m)?)?;
    m.add_function(wrap_pyfunction!(save, m)?)?;
    m.add_function(wrap_pyfunction!(save_staged, m)?)?;
    m.add_function(wrap_pyfunction!(save_sharing, m)?)?;
    m.add_function(wrap_pyfunction!(watch::watch_writes, m)?)?;
    m.add_function(wrap_pyfunction!(watch::record_watched, m)?)?;
    m.add_class::<watch::Watched>()?;
    m.add_function(wrap_pyfunction!(file_span, m)?)?;
    m.add_function(wrap_pyfunction!(load_buffer, m)?)?;
    m.add_function(wrap_pyfunction!(views::views, m)?)?;
    m.add_function(wrap_pyfunction!(save_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(encode_segments, m)?)?;
    m.add_function(wrap_pyfunction!(encode_sharing_segments, m)?)?;
    m.add_function(wrap_pyfunction!(stage, m)?)?;
    m.add_function(wrap_pyfunction!(release_clean_cache, m)?)?;
    m.add_function(wrap_pyfunction!(rename_directory, m)?)?;
    m.add_function(wrap_pyfunction!(acquire_lock, m)?)?;
    m.add_function(wrap_pyfunction!(compute::combine, m)?)?;
    m.add_function(wrap_pyfunction!(stats::tensor_stats, m)?)?;
    m.add_function(wrap_pyfunction!(stats::tensor_changes, m)?)?;
    m.add_function(wrap_pyfunction!(stats::histogram, m)?)?;
    #[cfg(feature = "test-hooks")]
    m.add_function(wrap_pyfunction!(_panic_for_test, m)?)?;
    m.add_class::<MappedFile>()?;
    m.add_class::<parameters::ParameterIndex>()?;
    m.add_class::<SaveProgress>()?;
    m.add_class::<Staging>()?;
    m.add_class::<Lock>()?;
    m.add_class::<in_place::InPlacePlan>()?;
    m.add_function(wrap_pyfunction!(in_place::in_place_plan, m)?)?;
    m.add_function(wrap_pyfunction!(in_place::grow_in_place, m)?)?;
    m.add_function(wrap_pyfunction!(in_place::placed_in_place, m)?)?;
    // The package's version is the crate's (one place: Cargo.toml), read from the compiled core
    // rather than the installed metadata, so a source tree and a wheel say the same.
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<signals::SignalOnDrop>()?;
    m.add("CHECKPOINT_VERSION", crate::format::CHECKPOINT_VERSION)?;
    m.add("TEMP_MARKER", crate::io::TEMP_MARKER)?;
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
