//! Early writeback for durable saves.
//!
//! A plain write()+fsync copies everything into the page cache first and only
//! then waits for the disk. Asking the kernel to start writing each piece back
//! as soon as it is written overlaps the disk's work with our copying, so the
//! final fsync finds little left to flush (benches/suite.py measures the result
//! against write()+fsync).

use std::fs::File;

use super::Progress;

/// Bytes handed to the kernel per write call, and per writeback request.
///
/// Small on purpose. On this project's machine, writing 1 GiB in calls of 4 MiB or
/// more stalled for 1-1.5 s in about half the rounds, while calls of 256 KiB never
/// did (benches/durable_patterns.py --plain: 16 rounds of 16,384 64 KiB tensors,
/// 0.26-0.33 s against 0.27-1.59 s with 32 MiB calls; the same on a transformer-like
/// mix). The 4,096 calls per GiB cost nothing measurable there, and the disk starts
/// early.
pub const PIECE: usize = 256 << 10;

/// Starts (does not wait for) writeback of `len` bytes at `offset`. Advisory:
/// an error here would surface again, and be reported, by the fsync that follows.
#[cfg(target_os = "linux")]
pub fn start_writeback(file: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    // SAFETY: a plain system call on a file descriptor we own for the call's duration.
    unsafe {
        libc::sync_file_range(
            file.as_raw_fd(),
            offset as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WRITE,
        );
    }
}

/// Elsewhere the final fsync does all the work, as after a plain write().
#[cfg(not(target_os = "linux"))]
pub fn start_writeback(_file: &File, _offset: u64, _len: u64) {}

/// What follows the writing of each piece: early writeback (durable saves), and
/// the progress count.
pub struct AfterEachPiece<'a> {
    pub writeback: bool,
    pub progress: &'a Progress,
}

impl AfterEachPiece<'_> {
    pub(crate) fn written(&self, file: &File, offset: u64, len: u64) {
        if self.writeback {
            start_writeback(file, offset, len);
        }
        self.progress.add(len);
    }
}
