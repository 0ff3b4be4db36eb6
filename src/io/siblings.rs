//! The hidden files ortckpt keeps beside a target while it works (temporaries, lock files):
//! their names, their permissions, and the lock test that tells a dead writer's from a live
//! one's. Below both the temporary files ([`super::atomic`]) and the lock files
//! ([`super::locks`]), which each use these and not each other's.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use super::mapped::FileId;

/// The longest file name most filesystems take (ext4, xfs, btrfs, tmpfs: NAME_MAX).
const NAME_MAX: usize = 255;

/// `.<name><marker>`: how the hidden siblings of `target` (its temporary files, its lock file)
/// begin. When that, plus `reserve` more bytes, would pass [`NAME_MAX`], the name is cut and a hash
/// of the whole of it added (the same in every process, so cleaners find them): a target with
/// a long but valid name can still be saved.
pub fn hidden_prefix(target: &Path, marker: &str, reserve: usize) -> String {
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let full = format!(".{name}{marker}");
    if full.len() + reserve <= NAME_MAX {
        return full;
    }
    let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3) // FNV-1a: stable, not secret
    });
    let mut keep = NAME_MAX.saturating_sub(reserve + marker.len() + 1 + 17);
    while !name.is_char_boundary(keep.min(name.len())) {
        keep -= 1;
    }
    format!(".{}~{hash:016x}{marker}", &name[..keep.min(name.len())])
}

/// The permissions of the files ortckpt keeps beside a target while it works (temporaries, lock
/// files): readable and writable by whoever may write the directory, by no one else. A reader of
/// the directory cannot open them, so cannot lock one and make a dead writer's look alive; a
/// writer of another user can, so a dead writer's can never stop it.
pub fn writers_mode(dir: &Path) -> u32 {
    use std::os::unix::fs::MetadataExt;
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let mode = fs::metadata(dir).map_or(0o700, |m| m.mode());
    0o600 | if mode & 0o020 != 0 { 0o060 } else { 0 } | if mode & 0o002 != 0 { 0o006 } else { 0 }
}

/// Whether `file` (open) is what `path` names now (not followed if a symlink).
pub fn still_named(file: &File, path: &Path) -> bool {
    FileId::of_file(file).is_some_and(|id| FileId::of_name(path) == Some(id))
}

/// Flags for files ortckpt opens by name: never through a symlink in the last component,
/// never inherited by child processes, never blocking on a FIFO.
pub const NO_FOLLOW: i32 = libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK;

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
    match lock_if_abandoned(path) {
        Some(file) => still_named(&file, path) && fs::remove_file(path).is_ok(),
        None => false, // held by a live writer, or no locks here: keep it
    }
}

/// Whether a live writer holds the lock of the regular file `path` (or nothing can tell).
pub fn is_held(path: &Path) -> bool {
    lock_if_abandoned(path).is_none_or(|file| file.unlock().is_err())
}

/// The regular file at `path`, opened and locked by us: only when no one held its lock.
fn lock_if_abandoned(path: &Path) -> Option<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(NO_FOLLOW)
        .open(path)
        .ok()?;
    if !file.metadata().is_ok_and(|m| m.is_file()) {
        return None;
    }
    file.try_lock().ok().map(|()| file)
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
}
