//! `_core.watch_writes` and `_core.record_watched`: the page watch of `crate::untouched` for a
//! save of Python's arrays, and what keeps a watched value's memory alive between saves: a weak
//! reference to the object at the root of its buffer (an array's last `base`, the one that owns
//! the memory). The page watch sees writes, not memory freed and allocated again (the kernel
//! may hand back zeroed pages with no write to see), so a record whose owner is gone, or whose
//! owner's memory moved, is forgotten before the next watched save arms, and one whose owner
//! cannot be referred to weakly is never kept. (The weak reference has a cost: NumPy refuses to
//! resize an array in place while one is held, so `ndarray.resize` of an array that owns its
//! memory and was recorded raises `ValueError`, `refcheck=False` or not, until it is forgotten.)

use std::collections::HashMap;
use std::sync::Mutex;

use pyo3::buffer::PyUntypedBuffer;
use pyo3::prelude::*;
use pyo3::types::PyWeakrefReference;

use super::guarded;
use super::records::{payloads_in, CheckpointIn, Export};
use crate::untouched::{self, Span};

/// What `watch_writes` armed for one save (nothing where the kernel offers no watch).
#[pyclass(frozen, module = "ortckpt._core")]
pub(super) struct Watched(Option<untouched::Armed>);

impl Watched {
    pub(super) fn armed(&self) -> Option<&untouched::Armed> {
        self.0.as_ref()
    }
}

/// Protects the pages of `checkpoint`'s values before a save of it to `path` reads them (see
/// `crate::untouched`), first forgetting the records of values whose memory may be gone.
#[pyfunction]
pub(super) fn watch_writes(
    py: Python<'_>,
    path: std::path::PathBuf,
    checkpoint: CheckpointIn<'_>,
) -> PyResult<Watched> {
    guarded(py, || {
        prune(py);
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
/// records where it keeps each watched value, tying each record to its memory's owner.
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
        attach(py, &buffers);
        Ok(())
    })
}

/// A recorded value's owner, weakly, and the span of the owner's memory when it was recorded.
struct Lifeline {
    owner: Py<PyWeakrefReference>,
    memory: Span,
}

/// Each recorded value's lifeline, by its span in memory.
static LIFELINES: Mutex<Option<HashMap<Span, Lifeline>>> = Mutex::new(None);

/// Before a watched save arms: forgets each record whose memory may have been freed since (its
/// owner gone, or never tied to one).
pub(super) fn prune(py: Python<'_>) {
    if !untouched::this_process_watches() {
        return; // (a forked child: no watch of its own, and its parent's lock may be held)
    }
    let mut guard = LIFELINES.lock().unwrap_or_else(|p| p.into_inner());
    let lifelines = guard.get_or_insert_with(HashMap::new);
    lifelines.retain(|_, line| {
        let owner = line.owner.bind(py).upgrade();
        owner.is_some_and(|owner| memory_of(&owner) == Some(line.memory))
    });
    untouched::forget_unless(|span| lifelines.contains_key(&span));
}

/// After a watched save: ties each new record to the owner of the value's memory (from
/// `exports`, the save's buffers), forgetting those it cannot tie; drops the lifelines of
/// records gone.
pub(super) fn attach(py: Python<'_>, exports: &[Export]) {
    if !untouched::this_process_watches() {
        return;
    }
    let mut guard = LIFELINES.lock().unwrap_or_else(|p| p.into_inner());
    let lifelines = guard.get_or_insert_with(HashMap::new);
    let recorded = untouched::recorded();
    lifelines.retain(|span, _| recorded.contains(span));
    let by_span: HashMap<Span, &Export> = exports
        .iter()
        .map(|e| ((e.buffer.buf_ptr() as usize, e.buffer.len_bytes()), e))
        .collect();
    let mut untied = Vec::new();
    for span in recorded {
        if lifelines.contains_key(&span) {
            continue;
        }
        let line = by_span.get(&span).and_then(|e| {
            let root = owner(e.values.bind(py))?;
            let memory = memory_of(&root)?;
            let weak = PyWeakrefReference::new(&root).ok()?;
            Some(Lifeline {
                owner: weak.unbind(),
                memory,
            })
        });
        match line {
            Some(line) => {
                lifelines.insert(span, line);
            }
            None => untied.push(span),
        }
    }
    if !untied.is_empty() {
        untouched::forget_unless(|span| !untied.contains(&span));
    }
}

/// The object at the root of `values`' `base` chain: the one whose life is its memory's.
fn owner<'py>(values: &Bound<'py, PyAny>) -> Option<Bound<'py, PyAny>> {
    let mut at = values.clone();
    for _ in 0..64 {
        match at.getattr("base") {
            Ok(base) if !base.is_none() => at = base,
            _ => return Some(at),
        }
    }
    None // (a chain this long is no array's)
}

/// The span of the memory `owner` exports now, if it exports any.
fn memory_of(owner: &Bound<'_, PyAny>) -> Option<Span> {
    let buffer = PyUntypedBuffer::get(owner).ok()?;
    Some((buffer.buf_ptr() as usize, buffer.len_bytes()))
}
