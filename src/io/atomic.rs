//! Temporary files beside their targets, and the writers that fill them.
//!
//! Temporary files are created exclusively (O_EXCL, O_NOFOLLOW) under unpredictable
//! names, so nothing planted in the directory is ever written through, and each is
//! locked by its writer until committed (see [`super::siblings`]): a cleaner removes only
//! those whose writer is gone, whatever their names say. [`super::commit`] renames them
//! into place.

use std::fs::{self, File, OpenOptions};
use std::io::{self, IoSlice, Seek, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::both_ends::{self, Placed};
use super::siblings::{self, hidden_prefix, still_named, writers_mode, NO_FOLLOW};
use super::writeback::{AfterEachPiece, PIECE};
use crate::error::{Error, Result};
use crate::seal::checksums::{Running, Sum};

/// Permissions of the files a save creates, before the umask: never writable by others.
const FILE_MODE: u32 = 0o644;

/// Marks temporary files, so that readers and cleaners can recognise them (the Python side
/// names its temporary files with the same marker: one rule for both).
pub const TEMP_MARKER: &str = ".ortckpt-tmp.";

/// Attempts at a fresh temporary name before giving up (each collision is a planted
/// file or a 1-in-2^128 coincidence).
const NAME_ATTEMPTS: usize = 16;

/// A temporary name for a save to `target`: hidden, in the same directory (rename is
/// only atomic within one filesystem), with 128 random bits.
pub fn temp_path_for(target: &Path) -> PathBuf {
    let random: String = crate::random::unpredictable_128()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    target.with_file_name(format!(
        "{}{random}",
        hidden_prefix(target, TEMP_MARKER, 32)
    ))
}

/// A temporary file beside its target, created exclusively and locked by this process until
/// it is renamed over the target ([`super::commit`] does that) or dropped, which removes it.
pub struct PendingFile {
    file: File,
    temp: PathBuf,
    target: PathBuf,
    committed: bool,
    /// The process that created it: a child forked meanwhile, dropping its copy, leaves it alone.
    owner: u32,
}

impl PendingFile {
    /// A new, empty temporary file for `target`.
    ///
    /// # Errors
    /// OS errors naming the target (or the temporary name, when it is the name that is taken).
    pub fn create(target: &Path) -> Result<PendingFile> {
        if target.file_name().is_none() {
            let e = io::Error::new(io::ErrorKind::InvalidInput, "the path names no file");
            return Err(Error::from(e).in_file(target));
        }
        let (file, temp) = create_locked_temp(target)?;
        Ok(PendingFile {
            file,
            temp,
            target: target.to_path_buf(),
            committed: false,
            owner: std::process::id(),
        })
    }

    pub fn file(&mut self) -> &mut File {
        &mut self.file
    }

    pub fn temp(&self) -> &Path {
        &self.temp
    }

    pub fn target(&self) -> &Path {
        &self.target
    }

    /// fsyncs the file (when `durable`) and gives it the permissions of a new file (0644
    /// less the umask): from private temporary to publishable.
    pub(crate) fn finish(&self, durable: bool) -> Result<()> {
        let in_temp = |e: io::Error| Error::from(e).in_file(&self.target);
        if durable {
            self.file.sync_all().map_err(in_temp)?;
        }
        let mode = FILE_MODE & !umask();
        self.file
            .set_permissions(fs::Permissions::from_mode(mode))
            .map_err(in_temp)
    }

    /// Locks-and-renames for a lock file: the new file (this user's, mode 0600, locked by
    /// us since its creation) takes the target's name; returns it, still locked.
    pub(crate) fn replace_target(mut self) -> Result<File> {
        self.rename_into_place()?;
        let file = self
            .file
            .try_clone()
            .map_err(|e| Error::from(e).in_file(&self.target))?;
        Ok(file)
    }

    /// Whether the target is still the file this one became at commit (no other save has
    /// replaced it since).
    pub fn is_target_now(&self) -> bool {
        still_named(&self.file, &self.target)
    }

    /// Renames the temporary file over its target (atomic within a filesystem).
    pub(crate) fn rename_into_place(&mut self) -> Result<()> {
        let replaced = held_if_large(&self.target);
        fs::rename(&self.temp, &self.target).map_err(|e| Error::from(e).in_file(&self.target))?;
        self.committed = true;
        if let Some(replaced) = replaced {
            let_go_of(replaced);
        }
        Ok(())
    }
}

impl Drop for PendingFile {
    fn drop(&mut self) {
        if !self.committed && std::process::id() == self.owner {
            let _ = fs::remove_file(&self.temp);
        }
        // The lock goes with the file descriptor, after the name is gone.
    }
}

/// Files from this size on are let go of on a thread of their own once replaced or removed.
const LET_GO_FROM: u64 = 16 << 20;

/// The regular file of `LET_GO_FROM` bytes or more that `path` names now (never followed),
/// held open across a rename or removal that unlinks it: the last close, not the unlink, then
/// frees its pages and blocks (tens of milliseconds per 100 MiB), and [`let_go_of`] takes that
/// off the saving thread.
pub(crate) fn held_if_large(path: &Path) -> Option<File> {
    let (file, len, _) = super::mapped::open(path, false).ok()?;
    (len >= LET_GO_FROM).then_some(file)
}

/// Closes `file` on a thread of its own (here, where none can be started, or where its
/// filesystem has less room left than twice its size: the next save of its size, begun at once,
/// may need the blocks this close frees, and a thread's close may come after that save's write,
/// which would then fail for want of space that a close here leaves it).
pub(crate) fn let_go_of(file: File) {
    if !room_without(&file) {
        return; // (closed here, as it goes out of scope)
    }
    #[cfg(test)]
    LET_GO.with(|n| n.set(n.get() + 1));
    let _ = std::thread::Builder::new()
        .name("ortckpt-let-go".into())
        .spawn(move || drop(file));
}

/// Whether `file`'s filesystem has room for two more of it while its own blocks are still held
/// (false where that cannot be read).
fn room_without(file: &File) -> bool {
    use std::os::fd::AsRawFd;
    let Ok(meta) = file.metadata() else {
        return false;
    };
    #[cfg(test)]
    if let Some(free) = FREE_SPACE.with(|f| f.get()) {
        return free >= meta.len().saturating_mul(2);
    }
    // SAFETY: fstatvfs writes only into the struct it is given, from a descriptor we hold.
    let mut fs: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstatvfs(file.as_raw_fd(), &mut fs) } != 0 {
        return false;
    }
    #[allow(clippy::useless_conversion)] // (u64 on 64-bit Linux, narrower elsewhere)
    let free = u64::from(fs.f_bavail).saturating_mul(u64::from(fs.f_frsize));
    free >= meta.len().saturating_mul(2)
}

#[cfg(test)]
thread_local! {
    /// Files this thread handed to a thread of their own so far (tests count them).
    pub(crate) static LET_GO: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    /// The free space [`room_without`] sees on this thread, where a test sets it.
    pub(crate) static FREE_SPACE: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

/// The process's umask, read without changing it (umask(2) sets as it reads, racing
/// other threads), at each save: a program may change it between saves. Where
/// /proc/self/status has no `Umask:` line (kernels before 4.7, no /proc), the usual 022.
fn umask() -> u32 {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("Umask:"))?;
            u32::from_str_radix(line.split_whitespace().nth(1)?, 8).ok()
        })
        .unwrap_or(0o022)
}

/// A new, empty temporary file for a save to `target`, created exclusively and locked.
fn create_locked_temp(target: &Path) -> Result<(File, PathBuf)> {
    create_locked_temp_named(target, std::iter::repeat_with(|| temp_path_for(target)))
}

/// [`create_locked_temp`] trying the names `names` gives (a test gives taken ones).
fn create_locked_temp_named(
    target: &Path,
    names: impl Iterator<Item = PathBuf>,
) -> Result<(File, PathBuf)> {
    let mut last = None;
    for temp in names.take(NAME_ATTEMPTS) {
        let file = match OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(NO_FOLLOW)
            .open(&temp)
        {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                last = Some(Error::from(e).in_file(&temp));
                continue;
            }
            Err(e) => return Err(Error::from(e).in_file(target)),
        };
        // Readable by the directory's writers alone (the umask may have taken more): a dead
        // save's temporary can be proven dead and removed by any of them, by no reader.
        let _ = file.set_permissions(fs::Permissions::from_mode(writers_mode(
            temp.parent().unwrap_or(Path::new(".")),
        )));
        match file.lock() {
            Ok(()) => {}
            Err(e) if siblings::locks_unsupported(&e) => return Ok((file, temp)),
            Err(e) => {
                let _ = fs::remove_file(&temp); // ours: created just now
                return Err(Error::from(e).in_file(&temp));
            }
        }
        // A cleaner may have taken it for a dead save's between our create and our lock.
        if still_named(&file, &temp) {
            return Ok((file, temp));
        }
    }
    Err(last.unwrap_or_else(|| {
        Error::from(io::Error::other("no temporary file could be created")).in_file(target)
    }))
}

/// The temporary files of saves to `target` that never committed, or still run.
pub fn pending_temps(target: &Path) -> Vec<PathBuf> {
    pending_temps_of(&[target])
}

/// [`pending_temps`] of targets in one directory, with one scan of it.
pub fn pending_temps_of(targets: &[&Path]) -> Vec<PathBuf> {
    let Some(first) = targets.first() else {
        return Vec::new();
    };
    let dir = match first.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let prefixes: Vec<String> = targets
        .iter()
        .map(|t| hidden_prefix(t, TEMP_MARKER, 32))
        .collect();
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            prefixes
                .iter()
                .any(|p| name.starts_with(p.as_str()))
                .then(|| dir.join(&name))
        })
        .collect()
}

/// Removes, of `temps` ([`pending_temps_of`]), what crashed or killed saves left
/// behind: temporary files no writer holds locked. Files of live saves (in any
/// process, this one included) are left alone.
pub fn remove_stale_temps(temps: &[PathBuf]) {
    for temp in temps {
        siblings::remove_if_abandoned(temp);
    }
}

/// fsyncs the directory holding `path`, so that renames into it survive a power cut.
pub fn sync_parent_dir(path: &Path) -> Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::from(e).in_file(dir))
}

/// Writes consecutive slices to a fresh file with few system calls (writev of
/// up to 1024 slices and [`PIECE`] bytes at a time) and no copy on our side;
/// `before` sees each piece (with its segment's index) just before it is written, while
/// it is in cache (the writer's checksums), and `after` runs on each batch once written.
/// Segments for which `hole` is true are skipped, not written: they read back as zeros
/// until the caller fills them in place (the file is sized to cover them) and reseals.
pub fn write_segments(
    file: &mut File,
    segments: &[&[u8]],
    hole: &dyn Fn(&[u8]) -> bool,
    before: &mut dyn FnMut(usize, &[u8]),
    after: &AfterEachPiece<'_>,
) -> io::Result<()> {
    const MAX_IOV: usize = 1024;
    let mut batch = Batch {
        slices: Vec::with_capacity(MAX_IOV),
        bytes: 0,
        position: 0,
    };
    let mut skipped = false;
    for (index, segment) in segments.iter().enumerate() {
        if !segment.is_empty() && hole(segment) {
            batch.flush(file, after)?;
            batch.position += segment.len() as u64;
            file.seek(io::SeekFrom::Start(batch.position))?;
            after.progress.add(segment.len() as u64);
            skipped = true;
            continue;
        }
        for piece in segment.chunks(PIECE) {
            if !batch.slices.is_empty()
                && (batch.slices.len() == MAX_IOV || batch.bytes + piece.len() > PIECE)
            {
                batch.flush(file, after)?;
            }
            before(index, piece);
            batch.bytes += piece.len();
            batch.slices.push(IoSlice::new(piece));
        }
    }
    batch.flush(file, after)?;
    if skipped {
        file.set_len(batch.position)?; // a hole at the end still counts in the length
    }
    Ok(())
}

/// The slices of one writev, and where in the file it goes.
struct Batch<'a> {
    slices: Vec<IoSlice<'a>>,
    bytes: usize,
    position: u64,
}

impl Batch<'_> {
    fn flush(&mut self, file: &mut File, after: &AfterEachPiece<'_>) -> io::Result<()> {
        if self.slices.is_empty() {
            return Ok(());
        }
        write_all_vectored(file, &mut self.slices)?;
        after.written(file, self.position, self.bytes as u64);
        self.position += self.bytes as u64;
        self.slices.clear();
        self.bytes = 0;
        Ok(())
    }
}

fn write_all_vectored(file: &mut File, slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    let mut rest = slices;
    while !rest.is_empty() {
        match file.write_vectored(rest) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "failed to write the checkpoint",
                ))
            }
            Ok(n) => IoSlice::advance_slices(&mut rest, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes values at their offsets with positioned writes from up to `threads`
/// threads, after sizing the file to `len` (gaps read back as zeros).
///
/// Chosen over a shared writable memory map and over one sequential writer by
/// measurement on this project's machine (benches/writers.rs): at 4 GiB, where
/// the kernel throttles dirty pages, two pwrite threads had the best median and
/// the tightest spread; at 1 GiB they were within 8 % of one sequential writer,
/// and the memory map was slowest at both sizes (a page fault per 4 KiB page).
/// On tmpfs, where a file takes one write(2) at a time, a private file is filled from both
/// ends instead ([`super::both_ends`]). `after` runs on each [`PIECE`] as soon as it is
/// written. Returns each value's checksum, taken piece by piece just before the piece is
/// written (while it is in cache).
pub fn write_at_parallel(
    file: &File,
    len: u64,
    values: &[(u64, &[u8])],
    threads: usize,
    after: &AfterEachPiece<'_>,
) -> io::Result<Vec<Sum>> {
    use std::os::unix::fs::FileExt;

    if both_ends::pays_for(file, len, threads) {
        let placed: Vec<Placed> = values
            .iter()
            .map(|&(offset, bytes)| Placed {
                offset,
                bytes,
                summed: true,
            })
            .collect();
        return both_ends::write_from_both_ends(file, len, &placed, after);
    }

    file.set_len(len)?;
    let threads = threads.clamp(1, values.len().max(1));
    let mut sums = vec![0; values.len()];
    // Deal the values out round-robin: neighbouring tensors go to different threads.
    let share = |t: usize| -> io::Result<Vec<Sum>> {
        let mut sums = Vec::new();
        for &(offset, bytes) in values.iter().skip(t).step_by(threads) {
            let mut at = offset;
            let mut sum = Running::default();
            for piece in bytes.chunks(PIECE) {
                sum.update(piece);
                file.write_all_at(piece, at)?;
                after.written(file, at, piece.len() as u64);
                at += piece.len() as u64;
            }
            sums.push(sum.finish());
        }
        Ok(sums)
    };
    std::thread::scope(|scope| {
        // A share whose thread cannot be had (RLIMIT_NPROC, a cgroup's pids.max) is written
        // by this thread after its own, rather than panic as `scope.spawn` does.
        let workers: Vec<_> = (1..threads)
            .map(|t| {
                std::thread::Builder::new()
                    .spawn_scoped(scope, move || share(t))
                    .ok()
            })
            .collect();
        let own = share(0);
        let others = workers.into_iter().enumerate().map(|(k, worker)| {
            worker.map_or_else(
                || share(k + 1),
                |worker| {
                    worker
                        .join()
                        .unwrap_or_else(|_| Err(io::Error::other("a writer thread panicked")))
                },
            )
        });
        // Every worker joined before any error returns (an unjoined one's panic would be the
        // scope's).
        let shares: Vec<_> = std::iter::once(own).chain(others).collect();
        for (t, of_worker) in shares.into_iter().enumerate() {
            let of_worker = of_worker?;
            for (k, sum) in of_worker.into_iter().enumerate() {
                sums[t + k * threads] = sum;
            }
        }
        Ok(sums)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::Progress;

    /// Slices of every kind of size: empty, tiny, and larger than one write piece.
    fn segments() -> Vec<Vec<u8>> {
        let sizes = [0, 1, 4, PIECE + 3, 7, 0, 2 * PIECE, 60, 1 << 20];
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|j| (i * 31 + j) as u8).collect())
            .collect()
    }

    #[test]
    fn when_every_temporary_name_is_taken_the_error_names_it_and_not_the_target() {
        let dir = tempfile::tempdir().unwrap();
        let (target, taken) = (dir.path().join("m"), dir.path().join(".m.ortckpt-tmp.same"));
        fs::write(&taken, b"taken").unwrap();
        let e = create_locked_temp_named(&target, std::iter::repeat(taken.clone())).unwrap_err();
        assert_eq!(e.path(), Some(taken.as_path()));
        assert_eq!(fs::read(&taken).unwrap(), b"taken");
        assert!(!target.exists());
    }

    #[test]
    fn write_segments_writes_every_byte_in_order_with_and_without_writeback() {
        let segments = segments();
        let slices: Vec<&[u8]> = segments.iter().map(Vec::as_slice).collect();
        let expected = segments.concat();
        for writeback in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("f");
            let mut file = File::create(&path).unwrap();
            let progress = Progress::default();
            let after = AfterEachPiece {
                writeback,
                progress: &progress,
            };
            let mut seen = vec![Vec::new(); slices.len()];
            let mut before = |i: usize, piece: &[u8]| seen[i].extend_from_slice(piece);
            write_segments(&mut file, &slices, &|_| false, &mut before, &after).unwrap();
            assert!(
                fs::read(&path).unwrap() == expected,
                "writeback {writeback}"
            );
            // Each piece was shown, once, as belonging to its segment.
            assert!(seen == segments, "writeback {writeback}");
            assert_eq!(progress.written(), expected.len() as u64);
        }
    }

    #[test]
    fn write_at_parallel_places_every_value_and_zeroes_the_gaps() {
        let segments = segments();
        let mut values = Vec::new();
        let mut expected = Vec::new();
        for s in &segments {
            expected.resize(expected.len().next_multiple_of(64), 0);
            values.push((expected.len() as u64, s.as_slice()));
            expected.extend_from_slice(s);
        }
        for (threads, writeback) in [(1, false), (2, true), (3, false)] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("f");
            let file = File::create(&path).unwrap();
            let progress = Progress::default();
            let after = AfterEachPiece {
                writeback,
                progress: &progress,
            };
            let sums =
                write_at_parallel(&file, expected.len() as u64, &values, threads, &after).unwrap();
            assert!(fs::read(&path).unwrap() == expected, "{threads} threads");
            let want: Vec<Sum> = segments
                .iter()
                .map(|s| crate::seal::checksums::sum(s))
                .collect();
            assert_eq!(sums, want, "{threads} threads");
            let value_bytes: usize = segments.iter().map(Vec::len).sum();
            assert_eq!(progress.written(), value_bytes as u64);
        }
    }
}
