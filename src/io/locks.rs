//! Advisory locks (flock): the only way ortckpt tells a live writer from a dead one.
//!
//! A lock is released by the kernel when its holder closes the file or dies (SIGKILL
//! included), so "I could take the lock" proves "nobody is using this", which a pid never
//! can (pids are reused, and every container's trainer is pid 1). Two rules make it hold:
//!
//! - Lock and verify: a lock is taken on an open file, and the file may be unlinked (by a
//!   cleaner, or by the previous holder) between the open and the lock; so after locking,
//!   the holder checks that the name still refers to the inode it locked, and otherwise
//!   starts again.
//! - Whoever removes a lock file or a temporary file holds its lock while removing it.
//!
//! On filesystems without locks (some NFS and Lustre mounts), taking a lock fails:
//! writers then go on without one and cleaners remove nothing they cannot prove dead.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::mapped::{ensure_regular, FileId};
use crate::error::{Error, Result};

/// Whether `file` (open) is what `path` names now (not followed if a symlink).
pub fn still_named(file: &File, path: &Path) -> bool {
    FileId::of_file(file).is_some_and(|id| FileId::of_name(path) == Some(id))
}

/// Flags for files ortckpt opens by name: never through a symlink in the last component,
/// never inherited by child processes, never blocking on a FIFO.
pub const NO_FOLLOW: i32 = libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK;

/// An exclusive lock on a lock file beside `target`, serializing the commits (renames) of
/// saves to `target` across threads and processes. The lock file is removed on drop, while
/// still locked, so no lock file outlives the saves that use it.
pub struct PathLock {
    file: File,
    path: PathBuf,
}

/// The lock file of `target`: `.<name>.ortckpt-lock` in the same directory.
pub fn lock_path_for(target: &Path) -> PathBuf {
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    target.with_file_name(format!(".{name}.ortckpt-lock"))
}

impl PathLock {
    /// Waits for and takes the lock of `target`. `None` where the filesystem has no locks.
    ///
    /// # Errors
    /// The lock file cannot be opened or created (a symlink planted there: ELOOP), naming it.
    pub fn acquire(target: &Path) -> Result<Option<PathLock>> {
        let path = lock_path_for(target);
        loop {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .custom_flags(NO_FOLLOW)
                .open(&path)
                .map_err(|e| Error::from(e).in_file(&path))?;
            // Something planted under the lock's name (a FIFO, a device) is not ours to lock.
            let meta = file.metadata().map_err(|e| Error::from(e).in_file(&path))?;
            ensure_regular(&meta, &path)?;
            match file.lock() {
                Ok(()) => {}
                Err(e) if locks_unsupported(&e) => return Ok(None),
                Err(e) => return Err(Error::from(e).in_file(&path)),
            }
            if still_named(&file, &path) {
                return Ok(Some(PathLock { file, path }));
            }
            // The previous holder removed this lock file after we opened it: take the new one.
        }
    }
}

impl Drop for PathLock {
    fn drop(&mut self) {
        // Removed while locked; a waiter that locks the removed inode sees it is no
        // longer named (still_named) and opens the path again.
        let _ = fs::remove_file(&self.path);
        let _ = self.file.unlock();
    }
}

/// Whether an error of flock means "this filesystem has no locks" rather than a failure.
pub fn locks_unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOLCK | libc::EOPNOTSUPP | libc::ENOSYS | libc::EINVAL)
    )
}

/// Removes the file at `path` if no one holds its lock (its writer is gone), holding the
/// lock while removing it. Returns whether it was removed. Anything that cannot be proven
/// abandoned (a held lock, a filesystem without locks, not a regular file) is left alone.
pub fn remove_if_abandoned(path: &Path) -> bool {
    let Ok(file) = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(NO_FOLLOW)
        .open(path)
    else {
        return false;
    };
    if !file.metadata().is_ok_and(|m| m.is_file()) {
        return false;
    }
    match file.try_lock() {
        Ok(()) => still_named(&file, path) && fs::remove_file(path).is_ok(),
        Err(_) => false, // held by a live writer, or no locks here: keep it
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_locked_file_is_kept_and_an_unlocked_one_removed() {
        let dir = tempfile::tempdir().unwrap();
        let (held, free) = (dir.path().join("held"), dir.path().join("free"));
        fs::write(&held, b"x").unwrap();
        fs::write(&free, b"x").unwrap();
        let holder = File::open(&held).unwrap();
        holder.lock().unwrap();
        assert!(!remove_if_abandoned(&held));
        assert!(remove_if_abandoned(&free));
        assert!(held.exists() && !free.exists());
        drop(holder);
        assert!(remove_if_abandoned(&held));
    }

    #[test]
    fn path_locks_exclude_each_other_and_leave_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("ck");
        let first = PathLock::acquire(&target).unwrap().unwrap();
        let other = File::open(lock_path_for(&target)).unwrap();
        assert!(other.try_lock().is_err());
        drop(first);
        assert!(!lock_path_for(&target).exists());
        let again = PathLock::acquire(&target).unwrap().unwrap();
        assert!(lock_path_for(&target).exists());
        drop(again);
    }

    #[test]
    fn a_symlink_at_the_lock_name_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("ck");
        let victim = dir.path().join("victim");
        fs::write(&victim, b"precious").unwrap();
        std::os::unix::fs::symlink(&victim, lock_path_for(&target)).unwrap();
        let e = PathLock::acquire(&target).err().expect("refused");
        assert_eq!(e.path(), Some(lock_path_for(&target).as_path()));
        assert_eq!(fs::read(&victim).unwrap(), b"precious");
    }
}
