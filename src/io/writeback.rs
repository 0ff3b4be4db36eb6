//! Early writeback for durable saves, and the page cache of a file about to be replaced.
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

/// Drops the page cache of the regular file at `path` (not followed if a symlink) when none of
/// it is dirty or under writeback, as a save about to replace it writes its successor: the
/// memory it frees is reused at once, as an overwrite in place reuses its own (ONNX Runtime's
/// saver truncates the file it replaces; an atomic save keeps the old file whole until the
/// commit). The file's bytes are untouched; pages a process maps stay. Advisory: false, and
/// nothing done, where the file cannot be opened or its cache not be read (`cachestat`, Linux
/// 6.5) or any of it is dirty (dropping then would start a write of what is being replaced).
#[cfg(target_os = "linux")]
pub fn release_clean_cache(path: &std::path::Path) -> bool {
    use std::os::fd::AsRawFd;

    let Ok((file, _, _)) = super::mapped::open(path, false) else {
        return false; // (missing, a symlink, not a regular file)
    };
    match cache_of(&file) {
        Some(stat) if stat.dirty == 0 && stat.writeback == 0 => {
            // SAFETY: a plain system call on our descriptor.
            stat.cache == 0
                || unsafe {
                    libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) == 0
                }
        }
        _ => false,
    }
}

/// What `cachestat(2)` says of a whole file's pages (in pages).
#[cfg(target_os = "linux")]
#[repr(C)]
#[derive(Debug, Default)]
struct CacheStat {
    cache: u64,
    dirty: u64,
    writeback: u64,
    evicted: u64,
    recently_evicted: u64,
}

/// `cachestat(2)` of all of `file`, or None where the kernel has none (before 6.5).
#[cfg(target_os = "linux")]
fn cache_of(file: &File) -> Option<CacheStat> {
    use std::os::fd::AsRawFd;
    #[repr(C)]
    struct Range {
        offset: u64,
        len: u64, // (0: to the end)
    }
    const SYS_CACHESTAT: libc::c_long = 451; // (the same number on every architecture)
    let range = Range { offset: 0, len: 0 };
    let mut stat = CacheStat::default();
    // SAFETY: cachestat with our descriptor, a range and a result of the kernel's layout.
    let rc = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            file.as_raw_fd(),
            &range as *const Range,
            &mut stat as *mut CacheStat,
            0u32,
        )
    };
    (rc == 0).then_some(stat)
}

/// Elsewhere the cache is left to the kernel.
#[cfg(not(target_os = "linux"))]
pub fn release_clean_cache(_path: &std::path::Path) -> bool {
    false
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::io::Write;

    /// A dirty file's cache is left (dropping it would start its writeback); once clean it is
    /// dropped and the bytes stay; a symlink, a directory and a missing file are refused.
    #[test]
    fn only_a_clean_regular_files_cache_is_released() {
        let dir = tempfile::tempdir_in(".").unwrap(); // (a disk filesystem: tmpfs keeps its pages)
        let path = dir.path().join("old.ckpt");
        let bytes: Vec<u8> = (0..(4 << 20)).map(|i| (i % 251) as u8).collect();
        let mut file = File::create(&path).unwrap();
        file.write_all(&bytes).unwrap();
        let Some(dirty) = cache_of(&file) else {
            assert!(!release_clean_cache(&path)); // (no cachestat: nothing is ever released)
            return;
        };
        if dirty.dirty > 0 {
            assert!(!release_clean_cache(&path));
            assert!(cache_of(&file).unwrap().cache > 0);
        }
        file.sync_all().unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        assert!(!release_clean_cache(&link));
        assert!(!release_clean_cache(dir.path()));
        assert!(!release_clean_cache(&dir.path().join("missing")));
        let before = cache_of(&file).unwrap().cache;
        assert!(before > 0);
        assert!(release_clean_cache(&path));
        // SAFETY: fstatfs fills the struct it is given, for our open descriptor.
        let on_tmpfs = unsafe {
            use std::os::fd::AsRawFd;
            let mut fs: libc::statfs = std::mem::zeroed();
            libc::fstatfs(file.as_raw_fd(), &mut fs) == 0 && fs.f_type == libc::TMPFS_MAGIC
        };
        if on_tmpfs {
            assert_eq!(cache_of(&file).unwrap().cache, before); // (tmpfs: the pages are the file)
        } else {
            assert!(cache_of(&file).unwrap().cache < before / 2);
        }
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
    }
}
