//! How far a save has got, readable from another thread while it runs: what a
//! progress bar polls. Counted per written piece, so it costs one atomic add per
//! [`PIECE`](super::writeback::PIECE) at most.

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Default)]
pub struct Progress {
    total: AtomicU64,
    written: AtomicU64,
}

impl Progress {
    /// Bytes of both files the save writes (0 until it has encoded the checkpoint).
    pub fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    /// Bytes handed to the kernel so far.
    pub fn written(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }

    pub(crate) fn begin(&self, total: u64) {
        self.written.store(0, Ordering::Relaxed);
        self.total.store(total, Ordering::Relaxed);
    }

    pub(crate) fn add(&self, bytes: u64) {
        self.written.fetch_add(bytes, Ordering::Relaxed);
    }
}
