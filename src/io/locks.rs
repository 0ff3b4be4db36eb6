//! Advisory locks (flock): the only way ortckpt tells a live writer from a dead one.
//!
//! A lock is released by the kernel when its holder closes the file or dies (SIGKILL
//! included), so "I could take the lock" proves "nobody is using this", which a pid never
//! can (pids are reused, and every container's trainer is pid 1). The rules that make it hold:
//!
//! - Lock and verify: a lock is taken on an open file, and the file may be unlinked (by a
//!   cleaner, or by the previous holder) between the open and the lock; so after locking,
//!   the holder checks that the name still refers to the inode it locked, and otherwise
//!   starts again.
//! - Whoever removes a lock file or a temporary file holds its lock while removing it.
//! - Only those who may write the directory can open a lock file (its mode mirrors the
//!   directory's writers: 0600 in a directory only its owner writes): flock needs nothing but an
//!   open descriptor, so a file anyone may read is a file anyone may lock, and a reader could
//!   then keep a crashed writer from ever resuming. A lock file another user left is used (or,
//!   if we may only read it, replaced) once nobody holds it.
//! - A lock belongs to the process that took it: a child forked meanwhile shares the locked
//!   file, and its exit neither removes the file nor unlocks it.
//! - Every wait has a deadline, and ends in [`ErrorKind::Locked`] naming the lock file and
//!   its holder, as the holder recorded itself in the file.
//!
//! On filesystems without locks (some NFS and Lustre mounts), taking a lock fails:
//! writers then go on without one and cleaners remove nothing they cannot prove dead.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::atomic::PendingFile;
use super::mapped::ensure_regular;
use super::siblings::{hidden_prefix, locks_unsupported, still_named, writers_mode, NO_FOLLOW};
use crate::error::{Error, ErrorKind, Result};

/// The longest wait a deadline may ask for: longer ones (infinity) are this.
const LONGEST_WAIT: Duration = Duration::from_secs(365 * 24 * 3600);

/// A wait of `seconds` (a caller's deadline): negative or NaN is an error, infinity or more
/// than a year is a year.
///
/// # Errors
/// [`ErrorKind::InvalidState`] for a negative or NaN number of seconds.
pub fn wait_of(seconds: f64) -> Result<Duration> {
    if seconds.is_nan() || seconds < 0.0 {
        return Err(Error::invalid_state(format!(
            "a lock timeout is a number of seconds >= 0, got {seconds}"
        )));
    }
    Ok(Duration::try_from_secs_f64(seconds).map_or(LONGEST_WAIT, |d| d.min(LONGEST_WAIT)))
}

/// How much of a lock file's holder record is read (it is a short line of text).
const HOLDER_RECORD_MAX: u64 = 1024;

/// How long a commit waits for another save of the same path to finish its renames
/// (milliseconds, unless it is stopped or stuck) before giving up.
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(60);

/// An exclusive lock on a lock file: serializes the commits of saves to one target, or
/// holds a manager's directory for its one writer. The lock file is removed on drop, while
/// still locked, so no lock file outlives its holder's use of it.
pub struct LockFile {
    file: File,
    path: PathBuf,
    /// The process that took it: a forked child that drops its copy leaves the lock alone.
    owner: u32,
}

/// The commit lock of `target`: `.<name>.ortckpt-lock` in the same directory (a long name cut, see
/// `hidden_prefix`).
pub fn lock_path_for(target: &Path) -> PathBuf {
    target.with_file_name(hidden_prefix(target, ".ortckpt-lock", 0))
}

/// The lock serializing commits to a target (see [`lock_path_for`]).
pub type PathLock = LockFile;

impl LockFile {
    /// Takes the commit lock of `target`, waiting at most `timeout`. `None` where the
    /// filesystem has no locks.
    ///
    /// # Errors
    /// As [`LockFile::acquire_file`].
    pub fn acquire(target: &Path, timeout: Duration) -> Result<Option<LockFile>> {
        Self::acquire_file(&lock_path_for(target), timeout, "")
    }

    /// Takes the lock file `path` (created if missing, mode 0600), waiting at most `timeout`
    /// (zero: one try), then writes `record` and this process's id and host into it, for
    /// whoever finds it held. `None` where the filesystem has no locks.
    ///
    /// # Errors
    /// [`ErrorKind::Locked`], naming the file and the holder it records, when it stays held
    /// past the deadline or belongs to another user; OS errors naming the file (a symlink
    /// planted there: ELOOP), and anything but a regular file at its name.
    pub fn acquire_file(path: &Path, timeout: Duration, record: &str) -> Result<Option<LockFile>> {
        let deadline = Instant::now() + timeout.min(LONGEST_WAIT);
        let mut pause = Duration::from_millis(1);
        loop {
            let file = match open_lock_file(path) {
                Ok(file) => file,
                // Another user's, held: its holder may finish (a co-writer mid-commit), so wait.
                Err(e) if is_held_foreign(&e) && Instant::now() < deadline => {
                    std::thread::sleep(
                        pause.min(deadline.saturating_duration_since(Instant::now())),
                    );
                    pause = (pause * 2).min(Duration::from_millis(50));
                    continue;
                }
                Err(e) => return Err(e),
            };
            loop {
                match file.try_lock() {
                    Ok(()) => break,
                    Err(fs::TryLockError::Error(e)) if locks_unsupported(&e) => return Ok(None),
                    Err(fs::TryLockError::Error(e)) => return Err(Error::from(e).in_file(path)),
                    Err(fs::TryLockError::WouldBlock) => {}
                }
                if Instant::now() >= deadline {
                    return Err(locked(path, holder_of(&file)));
                }
                std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            if still_named(&file, path) {
                write_holder_record(&file, record);
                return Ok(Some(LockFile {
                    file,
                    path: path.to_path_buf(),
                    owner: std::process::id(),
                }));
            }
            // The previous holder removed this lock file after we opened it: take the new one.
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for LockFile {
    fn drop(&mut self) {
        if std::process::id() != self.owner {
            return; // a forked child's copy: closing it leaves the owner's lock held
        }
        // Removed while locked; a waiter that locks the removed inode sees it is no
        // longer named (still_named) and opens the path again. Unlocked explicitly: a child
        // forked meanwhile shares the lock until it execs or exits.
        if still_named(&self.file, &self.path) {
            let _ = fs::remove_file(&self.path);
        }
        let _ = self.file.unlock();
    }
}

/// Opens (creating it if missing) the lock file at `path`, readable and writable by those who may
/// write its directory (see the module's rules), refusing anything else at its name. A lock file
/// of another user is used when we may write it; one we may only read is replaced by one of ours
/// when nobody holds it.
fn open_lock_file(path: &Path) -> Result<File> {
    let in_file = |e: io::Error| Error::from(e).in_file(path);
    let opened = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(NO_FOLLOW)
        .open(path);
    let file = match opened {
        Ok(file) => file,
        // Another user's file, which we may not write: replace it if nobody holds it.
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => return replace_foreign(path, e),
        Err(e) => return Err(in_file(e)),
    };
    // Something planted under the lock's name (a FIFO, a device) is not ours to lock.
    let meta = file.metadata().map_err(in_file)?;
    ensure_regular(&meta, path)?;
    let wanted = writers_mode(path.parent().unwrap_or(Path::new(".")));
    if meta.uid() == current_uid() && meta.mode() & 0o777 != wanted {
        // Ours, but open to readers of the directory (an older release made it 0644), or
        // closed to its other writers: their business is who may lock it.
        file.set_permissions(fs::Permissions::from_mode(wanted))
            .map_err(in_file)?;
    }
    Ok(file)
}

/// A lock file of another user at `path`, which we may not write: if we can read it and nobody
/// holds it, it is replaced, while we hold its lock (so nobody takes it meanwhile), by a new one
/// of ours. One held, or one we cannot even read (so cannot tell), is refused:
/// [`ErrorKind::Locked`].
fn replace_foreign(path: &Path, denied: io::Error) -> Result<File> {
    let in_file = |e: io::Error| Error::from(e).in_file(path);
    let meta = fs::symlink_metadata(path).map_err(in_file)?;
    if !meta.file_type().is_file() || meta.uid() == current_uid() {
        return Err(in_file(denied)); // not another user's file: the open's own error says why
    }
    let foreign = OpenOptions::new()
        .read(true)
        .custom_flags(NO_FOLLOW)
        .open(path)
        .map_err(|_| {
            foreign(
                path,
                meta.uid(),
                "neither it nor its lock can be opened by this user, so nothing tells whether its \
                 writer lives; if it is gone, remove the file",
            )
        })?;
    match foreign.try_lock() {
        Ok(()) => {}
        Err(fs::TryLockError::WouldBlock) => {
            let holder = holder_of(&foreign);
            return Err(foreign_held(path, meta.uid(), holder));
        }
        Err(fs::TryLockError::Error(e)) => return Err(in_file(e)),
    }
    if !still_named(&foreign, path) {
        return Err(in_file(io::Error::from(io::ErrorKind::Interrupted)));
    }
    let mine = PendingFile::create(path)?;
    let file = mine.replace_target()?;
    let _ = foreign.unlock();
    Ok(file)
}

fn current_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

fn foreign(path: &Path, uid: u32, why: &str) -> Error {
    Error::new(ErrorKind::Locked {
        problem: format!("the lock file belongs to another user (uid {uid}) and {why}"),
        holder: format!("uid {uid}"),
    })
    .in_file(path)
}

/// Whether `e` is [`foreign_held`]'s: another user's lock file, held now.
fn is_held_foreign(e: &Error) -> bool {
    matches!(e.kind(), ErrorKind::Locked { problem, .. } if problem.contains(HELD_BY_ANOTHER_USER))
}

const HELD_BY_ANOTHER_USER: &str = "belongs to another user, who holds it";

fn foreign_held(path: &Path, uid: u32, holder: String) -> Error {
    let who = if holder.is_empty() {
        format!("uid {uid}")
    } else {
        holder
    };
    Error::new(ErrorKind::Locked {
        problem: format!("the lock file {HELD_BY_ANOTHER_USER} (uid {uid}: {who})"),
        holder: who,
    })
    .in_file(path)
}

fn locked(path: &Path, holder: String) -> Error {
    let who = if holder.is_empty() {
        "holder unknown"
    } else {
        &holder
    };
    let problem = format!("held by another process past the deadline ({who})");
    Error::new(ErrorKind::Locked { problem, holder }).in_file(path)
}

/// `record` (the caller's, e.g. a JSON object) or, without one, this process's pid and host.
fn write_holder_record(file: &File, record: &str) {
    use std::os::unix::fs::FileExt;
    let line = if record.is_empty() {
        format!("pid {} on {}", std::process::id(), hostname())
    } else {
        record.to_owned()
    };
    // Advisory: a holder that cannot say who it is still holds the lock.
    let _ = file.set_len(0);
    let _ = file.write_all_at(line.as_bytes(), 0);
}

/// What the holder of `file` recorded (printable characters only: it goes into messages).
pub fn holder_of(file: &File) -> String {
    let mut text = String::new();
    let _ = file.take(HOLDER_RECORD_MAX).read_to_string(&mut text);
    text.chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect::<String>()
        .trim()
        .to_owned()
}

fn hostname() -> String {
    fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: Duration = Duration::ZERO;

    #[test]
    fn path_locks_exclude_each_other_and_leave_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("ck");
        let first = PathLock::acquire(&target, NOW).unwrap().unwrap();
        let other = File::open(lock_path_for(&target)).unwrap();
        assert!(other.try_lock().is_err());
        drop(first);
        assert!(!lock_path_for(&target).exists());
        let again = PathLock::acquire(&target, NOW).unwrap().unwrap();
        assert!(lock_path_for(&target).exists());
        let mode = fs::metadata(lock_path_for(&target)).unwrap().mode();
        assert_eq!(mode & 0o777, 0o600); // (a temporary directory: its owner's alone)
        drop(again);
    }

    #[test]
    fn a_held_lock_ends_in_a_typed_error_naming_the_holder_at_the_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lock");
        let _held = LockFile::acquire_file(&path, NOW, "the first holder")
            .unwrap()
            .unwrap();
        let started = Instant::now();
        let e = LockFile::acquire_file(&path, Duration::from_millis(200), "")
            .err()
            .expect("refused");
        assert!(started.elapsed() >= Duration::from_millis(200));
        assert!(
            matches!(e.kind(), ErrorKind::Locked { holder, .. } if holder == "the first holder")
        );
        assert_eq!(e.path(), Some(path.as_path()));
    }

    #[test]
    fn a_lock_file_is_open_to_the_directorys_writers_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lock");
        fs::write(&path, b"").unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let lock = LockFile::acquire_file(&path, NOW, "").unwrap().unwrap();
        assert_eq!(fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        drop(lock);
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o777)).unwrap();
        let lock = LockFile::acquire_file(&path, NOW, "").unwrap().unwrap();
        assert_eq!(fs::metadata(&path).unwrap().mode() & 0o777, 0o666);
        drop(lock);
    }

    #[test]
    fn waits_are_bounded_and_bad_ones_refused() {
        assert_eq!(wait_of(1.5).unwrap(), Duration::from_millis(1500));
        assert_eq!(wait_of(f64::INFINITY).unwrap(), LONGEST_WAIT);
        assert_eq!(wait_of(1e30).unwrap(), LONGEST_WAIT);
        assert!(wait_of(-1.0).is_err() && wait_of(f64::NAN).is_err());
    }

    #[test]
    fn a_symlink_at_the_lock_name_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("ck");
        let victim = dir.path().join("victim");
        fs::write(&victim, b"precious").unwrap();
        std::os::unix::fs::symlink(&victim, lock_path_for(&target)).unwrap();
        let e = PathLock::acquire(&target, NOW).err().expect("refused");
        assert_eq!(e.path(), Some(lock_path_for(&target).as_path()));
        assert_eq!(fs::read(&victim).unwrap(), b"precious");
    }
}
