//! Early writeback for durable saves.
//!
//! A plain write()+fsync copies everything into the page cache first and only
//! then waits for the disk. Asking the kernel to start writing each piece back
//! as soon as it is written overlaps the disk's work with our copying, so the
//! final fsync finds little left to flush (benches/suite.py measures the result
//! against write()+fsync).

use std::fs::File;

use super::Progress;

/// Bytes handed to the kernel per write call, and per writeback request: large
/// enough that system calls cost nothing measurable, small enough that the disk
/// starts early.
pub const PIECE: usize = 32 << 20;

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
