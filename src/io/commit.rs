//! The one commit: how ortckpt publishes a file, or a checkpoint and its data file, in
//! place of what was there. Every save, every output of the tools (arithmetic, upgrade,
//! export, convert, decompress) and every document a step rewrites goes through
//! [`Staged::commit`]; step directories go through [`rename_directory`]. Nothing else
//! renames into place.
//!
//! The protocol:
//! 1. The new files are written in full into temporary files beside their targets
//!    ([`PendingFile`]: exclusive, unpredictable, private and locked while written).
//! 2. They are fsynced (durable saves) and given the permissions of a new file.
//! 3. Under the target's commit lock (a deadline, never a wait for ever), the data file is
//!    renamed first and the file that points into it last, so a crash between the two
//!    leaves the previous checkpoint beside the new data file, which their pair trailers
//!    tell apart (see [`crate::seal::pairing`]). A save without a data file removes the
//!    `<target>.data` of the checkpoint it replaces (the one carrying its pair trailer),
//!    never an unrelated file of that name.
//! 4. Temporary files of saves whose writers died (their locks free) are removed, and
//!    with `durable` the directory is fsynced.
//!
//! Renaming, never writing in place, keeps live mappings of the old file valid: the old
//! inode lives on until its last mapping goes.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::atomic::{
    held_if_large, let_go_of, pending_temps_of, remove_stale_temps, sync_parent_dir, PendingFile,
};
use super::locks::{self, PathLock};
use super::siblings::{self, NO_FOLLOW};
use crate::error::{Error, Result};
use crate::seal::external_data_path;
use crate::seal::pairing::{self, PairId, PAIR_TRAILER_LEN};

/// A file (and, for a checkpoint with external data, its data file) being written, not yet
/// in place. Dropped without [`Staged::commit`], its temporary files go and the target is
/// untouched.
pub struct Staged {
    target: PathBuf,
    main: PendingFile,
    data: Option<PendingFile>,
}

/// How a [`Staged`] commits.
#[derive(Clone, Copy, Debug)]
pub struct CommitOptions {
    /// fsync the files and their directory before returning.
    pub durable: bool,
    /// How long to wait for another save of the same target to finish its commit.
    pub lock_timeout: Duration,
    /// The files carry no pair trailer (an ONNX model and its external data), so nothing could
    /// tell the previous file beside the new data file: the previous one is moved out of sight
    /// before the data file is renamed, and a crash between the renames leaves no file at the
    /// target, never a silent mix of two saves.
    pub unpaired: bool,
}

impl Default for CommitOptions {
    fn default() -> Self {
        CommitOptions {
            durable: false,
            lock_timeout: locks::DEFAULT_LOCK_TIMEOUT,
            unpaired: false,
        }
    }
}

impl Staged {
    /// Fresh temporary files for `target` (and for `<target>.data` when `with_data`).
    ///
    /// # Errors
    /// OS errors naming the target; a path that names no file.
    pub fn new(target: &Path, with_data: bool) -> Result<Staged> {
        sweep_dead_temps(target);
        let data = if with_data {
            Some(PendingFile::create(&external_data_path(target))?)
        } else {
            None
        };
        Ok(Staged {
            target: target.to_path_buf(),
            main: PendingFile::create(target)?,
            data,
        })
    }

    pub fn target(&self) -> &Path {
        &self.target
    }

    /// The file that replaces the target.
    pub fn main(&mut self) -> &mut PendingFile {
        &mut self.main
    }

    /// The file that replaces `<target>.data`, if one is staged.
    pub fn data(&mut self) -> Option<&mut PendingFile> {
        self.data.as_mut()
    }

    /// Drops the staged data file (removed, never committed): the checkpoint needs none.
    pub fn drop_data(&mut self) {
        self.data = None;
    }

    /// Publishes the staged files in place of the target's (see the module's protocol).
    ///
    /// # Errors
    /// OS errors naming the file; [`crate::ErrorKind::Locked`] when another save of the
    /// target holds its commit lock past `options.lock_timeout`. Before the first rename the
    /// target is untouched; the temporary files are removed on any error.
    pub fn commit(mut self, options: &CommitOptions) -> Result<()> {
        let data_path = external_data_path(&self.target);
        self.main.finish(options.durable)?;
        if let Some(data) = &self.data {
            data.finish(options.durable)?;
        }
        let ours = [Some(self.main.temp()), self.data.as_ref().map(|d| d.temp())];
        let mut leftovers = pending_temps_of(&[&self.target, &data_path]);
        leftovers.retain(|temp| !ours.contains(&Some(temp.as_path())));
        match &mut self.data {
            Some(data) => {
                // Commits of one target, from any thread or process, take turns: the two renames
                // of one save are never interleaved with another's.
                let _lock = PathLock::acquire(&self.target, options.lock_timeout)?;
                // What this save replaces, moved out of sight first, so that a failed rename can
                // put it back: a checkpoint's previous data file (the previous checkpoint stays
                // whole beside it); or, for files without pair trailers, the previous file itself
                // (nothing could tell it beside the new data file: no file beats a silent mix).
                let moved = if options.unpaired {
                    &self.target
                } else {
                    &data_path
                };
                let previous = retire(moved)?;
                let put_back = |previous: &Option<PathBuf>| {
                    if let Some(previous) = previous {
                        let _ = fs::rename(previous, moved);
                    }
                };
                if let Err(e) = data.rename_into_place() {
                    put_back(&previous);
                    return Err(e);
                }
                if let Err(e) = self.main.rename_into_place() {
                    if options.unpaired {
                        return Err(e);
                    }
                    // Nothing of this save is in place but its data file: the previous one back.
                    put_back(&previous);
                    return Err(e);
                }
                if let Some(previous) = previous {
                    let held = held_if_large(&previous);
                    let _ = fs::remove_file(previous);
                    if let Some(held) = held {
                        let_go_of(held);
                    }
                }
                // Only now, and under the lock: until a save has committed, a crashed save's
                // temporary checkpoint may be the one that matches the data file (see load).
                remove_stale_temps(&leftovers);
            }
            None if leftovers.is_empty() && fs::symlink_metadata(&data_path).is_err() => {
                // Nothing to judge: one rename is atomic by itself, and an inline save waits
                // for nobody's lock. A data file that a save with external data commits
                // meanwhile is judged after, under the lock.
                self.main.rename_into_place()?;
                if fs::symlink_metadata(&data_path).is_ok() {
                    // It appeared during this commit: a save with external data committed between
                    // the look above and the rename, and this checkpoint replaced its checkpoint.
                    // Judged under the lock (no save is then between its renames): while this is
                    // still the target, a data file with a pair trailer is that save's, and stale.
                    let _lock = PathLock::acquire(&self.target, options.lock_timeout)?;
                    if self.main.is_target_now() {
                        if let Some(id) = pair_id_of_file(&data_path) {
                            remove_data_of(&data_path, &[id])?;
                        }
                    }
                }
            }
            None => {
                // A data file, or leftovers, to judge while nothing else moves.
                let _lock = PathLock::acquire(&self.target, options.lock_timeout)?;
                let replaced = replaced_pairs(&self.target, &leftovers);
                self.main.rename_into_place()?;
                remove_data_of(&data_path, &replaced)?;
                remove_stale_temps(&leftovers);
            }
        }
        if options.durable {
            sync_parent_dir(&self.target)?;
        }
        Ok(())
    }
}

/// Removes the temporary files that saves of `target` killed earlier left (their locks free),
/// before this one stages its own: they may fill the disk that this save needs. Kept: a dead
/// temporary that loading needs (a save killed between its renames), until a save commits again.
fn sweep_dead_temps(target: &Path) {
    let data_path = external_data_path(target);
    for temp in pending_temps_of(&[target, &data_path]) {
        let (main, data, this) = (
            pair_id_of_file(target),
            pair_id_of_file(&data_path),
            pair_id_of_file(&temp),
        );
        // While the files in place come from different saves, loading reads the dead temporary
        // that matches one of them: the new checkpoint, or the previous data file.
        let needed = this.is_some() && main != data && (this == data || this == main);
        if !needed {
            siblings::remove_if_abandoned(&temp);
        }
    }
}

/// The pair ids a save without a data file supersedes: the checkpoint it replaces, and the
/// checkpoints of interrupted saves (temporary files whose writers died), which a data file
/// left in place may belong to.
fn replaced_pairs(target: &Path, leftovers: &[PathBuf]) -> Vec<PairId> {
    let abandoned = leftovers.iter().filter(|temp| !siblings::is_held(temp));
    std::iter::once(target)
        .chain(abandoned.map(PathBuf::as_path))
        .filter_map(pair_id_of_file)
        .collect()
}

/// Moves the file at `target` (if any) out of sight, under a temporary name of its own (which a
/// later commit sweeps, should this one be killed before removing it): its path, or None.
fn retire(target: &Path) -> Result<Option<PathBuf>> {
    if fs::symlink_metadata(target).is_err() {
        return Ok(None);
    }
    let hidden = super::atomic::temp_path_for(target);
    match fs::rename(target, &hidden) {
        Ok(()) => Ok(Some(hidden)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::from(e).in_file(target)),
    }
}

/// Removes the data file at `data_path` when it ends with one of `pairs`: a data file of a
/// checkpoint this save replaced. Anything else there (a user's own file, another save's
/// data) stays.
fn remove_data_of(data_path: &Path, pairs: &[PairId]) -> Result<()> {
    let stale = pair_id_of_file(data_path).is_some_and(|id| pairs.contains(&id));
    if !stale {
        return Ok(());
    }
    match fs::remove_file(data_path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(Error::from(e).in_file(data_path)),
        _ => Ok(()),
    }
}

/// The pair id a regular file at `path` ends with (not following a symlink), if any.
pub fn pair_id_of_file(path: &Path) -> Option<PairId> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(NO_FOLLOW)
        .open(path)
        .ok()?;
    let meta = file.metadata().ok()?;
    let at = meta
        .is_file()
        .then_some(meta.len())?
        .checked_sub(PAIR_TRAILER_LEN as u64)?;
    let mut tail = [0u8; PAIR_TRAILER_LEN];
    file.read_exact_at(&mut tail, at).ok()?;
    pairing::pair_id(&tail)
}

/// Renames the directory `from` to `to`, which must not exist (RENAME_NOREPLACE: an empty
/// directory at `to` is not replaced either), then fsyncs the parent of `to` when `durable`.
/// How a step directory is committed and how it is retired.
///
/// # Errors
/// `AlreadyExists` when `to` exists; other OS errors, naming `to`.
pub fn rename_directory(from: &Path, to: &Path, durable: bool) -> Result<()> {
    if durable {
        File::open(from)
            .and_then(|d| d.sync_all())
            .map_err(|e| Error::from(e).in_file(from))?;
    }
    rename_noreplace(from, to).map_err(|e| Error::from(e).in_file(to))?;
    if durable {
        sync_parent_dir(to)?;
    }
    Ok(())
}

fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| CString::new(p.as_os_str().as_bytes()).map_err(io::Error::other);
    let (from_c, to_c) = (c(from)?, c(to)?);
    // SAFETY: both pointers are NUL-terminated strings that outlive the call.
    let done = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from_c.as_ptr(),
            libc::AT_FDCWD,
            to_c.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if done == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        // A filesystem without RENAME_NOREPLACE: a plain rename, which still refuses a
        // non-empty directory and a file at `to`; an empty directory there it would replace.
        Some(libc::EINVAL | libc::ENOSYS) if fs::symlink_metadata(to).is_err() => {
            fs::rename(from, to)
        }
        Some(libc::EINVAL | libc::ENOSYS) => Err(io::Error::from(io::ErrorKind::AlreadyExists)),
        _ => Err(e),
    }
}

/// Writes `bytes` as the file `target`, replacing it through the one commit.
///
/// # Errors
/// As [`Staged::commit`], and the OS errors of writing.
pub fn write_file(target: &Path, bytes: &[u8], options: &CommitOptions) -> Result<()> {
    use std::io::Write;
    let mut staged = Staged::new(target, false)?;
    staged
        .main()
        .file()
        .write_all(bytes)
        .map_err(|e| Error::from(e).in_file(target))?;
    staged.commit(options)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::seal::pairing::trailer;

    fn with_trailer(body: &[u8], id: &PairId) -> Vec<u8> {
        let mut out = body.to_vec();
        out.extend_from_slice(&trailer(id));
        out
    }

    /// A replaced file of 16 MiB or more is held across the rename and closed on a thread of its
    /// own: the new bytes are in place at once, and the old file is not kept open for long.
    #[test]
    fn a_large_replaced_file_is_let_go_of_off_the_saving_thread_and_not_kept() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("big");
        fs::write(&target, vec![1u8; 17 << 20]).unwrap();
        let old = fs::metadata(&target).unwrap().ino();
        let let_go = super::super::atomic::LET_GO.with(|n| n.get());
        write_file(&target, b"new", &CommitOptions::default()).unwrap();
        assert_eq!(super::super::atomic::LET_GO.with(|n| n.get()), let_go + 1);
        assert_eq!(fs::read(&target).unwrap(), b"new");
        let open_still = || {
            fs::read_dir("/proc/self/fd")
                .unwrap()
                .flatten()
                .any(|fd| fs::metadata(fd.path()).is_ok_and(|m| m.ino() == old && m.nlink() == 0))
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while open_still() {
            assert!(
                std::time::Instant::now() < deadline,
                "the replaced file stayed open"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(held_if_large(&target).is_none()); // (3 bytes: closed where it is)
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(held_if_large(&link).is_none()); // (never followed)
    }

    /// Where the filesystem has less room left than twice the replaced file, it is closed on the
    /// saving thread, before the save returns: the next save of its size, begun at once, finds
    /// its blocks free (a thread's close, still under way, failed 30 of 200 such saves on a
    /// 48 MiB tmpfs with ENOSPC).
    #[test]
    fn a_large_replaced_file_on_a_nearly_full_filesystem_is_closed_before_the_save_returns() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("big");
        fs::write(&target, vec![1u8; 17 << 20]).unwrap();
        let old = fs::metadata(&target).unwrap().ino();
        let let_go = super::super::atomic::LET_GO.with(|n| n.get());
        super::super::atomic::FREE_SPACE.with(|f| f.set(Some(30 << 20)));
        let written = write_file(&target, b"new", &CommitOptions::default());
        super::super::atomic::FREE_SPACE.with(|f| f.set(None));
        written.unwrap();
        assert_eq!(super::super::atomic::LET_GO.with(|n| n.get()), let_go); // (none handed to a thread)
        assert_eq!(fs::read(&target).unwrap(), b"new");
        let open_still = fs::read_dir("/proc/self/fd")
            .unwrap()
            .flatten()
            .any(|fd| fs::metadata(fd.path()).is_ok_and(|m| m.ino() == old && m.nlink() == 0));
        assert!(
            !open_still,
            "the replaced file was still open when the save returned"
        );
    }

    #[test]
    fn a_file_replaces_its_target_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("f");
        fs::write(&target, b"old").unwrap();
        write_file(&target, b"new", &CommitOptions::default()).unwrap();
        assert_eq!(fs::read(&target).unwrap(), b"new");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn the_replaced_checkpoints_data_file_goes_and_an_unrelated_one_stays() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("ck");
        let data = external_data_path(&target);
        let old = pairing::new_pair_id();
        fs::write(&target, with_trailer(b"checkpoint", &old)).unwrap();
        fs::write(&data, with_trailer(b"values", &old)).unwrap();
        write_file(&target, b"inline", &CommitOptions::default()).unwrap();
        assert!(
            !data.exists(),
            "the replaced checkpoint's data file is stale"
        );

        // A data file of another pair, or none at all, is not this save's to remove.
        fs::write(&data, with_trailer(b"values", &pairing::new_pair_id())).unwrap();
        write_file(&target, b"inline again", &CommitOptions::default()).unwrap();
        assert!(data.exists());
        fs::write(&data, b"a user's own file").unwrap();
        write_file(&target, b"and again", &CommitOptions::default()).unwrap();
        assert_eq!(fs::read(&data).unwrap(), b"a user's own file");
    }

    #[test]
    fn a_dropped_stage_leaves_the_target_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("ck");
        fs::write(&target, b"old").unwrap();
        let mut staged = Staged::new(&target, true).unwrap();
        staged.main().file().write_all_at(b"new", 0).unwrap();
        drop(staged);
        assert_eq!(fs::read(&target).unwrap(), b"old");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn directories_are_renamed_but_never_over_an_existing_one() {
        let dir = tempfile::tempdir().unwrap();
        let (from, to) = (dir.path().join("a"), dir.path().join("b"));
        fs::create_dir(&from).unwrap();
        fs::create_dir(&to).unwrap();
        let e = rename_directory(&from, &to, false).unwrap_err();
        assert!(
            matches!(e.kind(), crate::ErrorKind::Io(io) if io.kind() == io::ErrorKind::AlreadyExists)
        );
        fs::remove_dir(&to).unwrap();
        rename_directory(&from, &to, true).unwrap();
        assert!(to.is_dir() && !from.exists());
    }
}
