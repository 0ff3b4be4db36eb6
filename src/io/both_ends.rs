//! Filling a file on tmpfs from both ends at once: this thread writes from the front with
//! positioned writes while a helper thread copies from the back through a shared mapping.
//!
//! Why: tmpfs serialises every write(2) to one file on the inode's lock, so two writer threads
//! take the time of one (measured: two pwrite threads, the same wall time for twice the CPU).
//! Page faults on a shared mapping take no inode lock, so the helper's copies run beside the
//! writes. A page costs the mapping about twice what it costs write(2) (about 1.0 s against
//! 0.46 s a GiB on this project's machine), so the two claim values from their ends and meet
//! where their speeds put them: no fixed split to tune. Measured in benches/save_vs_write.py.
//!
//! Why only tmpfs, and only a file no one else may write: a store into a mapping whose page
//! cannot be had (a full filesystem, or the file truncated by another process) is SIGBUS, the
//! end of the process, where write(2) returns an error. So the helper first populates each
//! range with `MADV_POPULATE_WRITE`, which reports that as an error instead (EFAULT), and then
//! copies into pages that are there; on tmpfs nothing takes them away again (no writeback, no
//! block to allocate at the next store). The file must be this user's and closed to the writes
//! of others (no group or other write bit), so no other user can truncate it under the copy.
//! On disk filesystems a store can still need a new block (copy-on-write, or after writeback),
//! so they keep plain writes.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use memmap2::MmapRaw;

use super::writeback::{AfterEachPiece, PIECE};
use crate::seal::checksums::{Running, Sum};

/// One run of bytes to place in the file: where, and whether its checksum is wanted.
#[derive(Clone, Copy, Debug)]
pub struct Placed<'a> {
    pub offset: u64,
    pub bytes: &'a [u8],
    pub summed: bool,
}

/// Below this many bytes one writer does it all: a mapping and a thread cost more than they
/// save.
const MIN_BYTES: u64 = 16 << 20;

/// Linux 5.14+: fault pages in writable, as a store would, without storing.
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// Most slices in one pwritev (the kernel's IOV_MAX).
const MAX_IOV: usize = 1024;

/// Whether `file` (a save's temporary, open for reading and writing) should be filled from
/// both ends: `bytes` worth it, `threads` allowing a helper, on tmpfs, owned by this user and
/// writable by no one else.
pub fn pays_for(file: &File, bytes: u64, threads: usize) -> bool {
    threads >= 2 && bytes >= MIN_BYTES && on_tmpfs(file) && writable_by_us_alone(file)
}

fn on_tmpfs(file: &File) -> bool {
    // SAFETY: fstatfs fills the struct it is given, for a descriptor open for the call.
    unsafe {
        let mut fs: libc::statfs = std::mem::zeroed();
        libc::fstatfs(file.as_raw_fd(), &mut fs) == 0 && fs.f_type == libc::TMPFS_MAGIC
    }
}

fn writable_by_us_alone(file: &File) -> bool {
    // SAFETY: geteuid has no failure and no side effect.
    let me = unsafe { libc::geteuid() };
    file.metadata()
        .is_ok_and(|m| m.is_file() && m.uid() == me && m.mode() & 0o022 == 0)
}

/// Writes `values` (in file order, not overlapping) into `file` after sizing it to `len`
/// (gaps read back as zeros): this thread from the front, a helper from the back through a
/// shared mapping (see the module's comment for when that is safe: [`pays_for`]). `after`
/// sees every piece once written. Returns each value's checksum (0 where not `summed`), taken
/// piece by piece just before the piece is written, while it is in cache.
///
/// # Errors
/// OS errors of either writer: the first one stops both. A page the helper cannot have (a full
/// tmpfs) is ENOSPC, never a signal.
pub fn write_from_both_ends(
    file: &File,
    len: u64,
    values: &[Placed<'_>],
    after: &AfterEachPiece<'_>,
) -> io::Result<Vec<Sum>> {
    fill(file, len, values, after, Writers::Both)
}

/// Who writes: both, or (for tests of each alone) one of them.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Writers {
    Both,
    #[cfg(test)]
    FrontOnly,
    #[cfg(test)]
    HelperOnly,
    /// Both, the helper panicking at its start.
    #[cfg(test)]
    HelperPanics,
}

impl Writers {
    fn front(self) -> bool {
        match self {
            Writers::Both => true,
            #[cfg(test)]
            Writers::FrontOnly => true,
            #[cfg(test)]
            Writers::HelperOnly => false,
            #[cfg(test)]
            Writers::HelperPanics => true,
        }
    }

    fn helper(self) -> bool {
        match self {
            Writers::Both => true,
            #[cfg(test)]
            Writers::FrontOnly => false,
            #[cfg(test)]
            Writers::HelperOnly => true,
            #[cfg(test)]
            Writers::HelperPanics => true,
        }
    }
}

fn fill(
    file: &File,
    len: u64,
    values: &[Placed<'_>],
    after: &AfterEachPiece<'_>,
    writers: Writers,
) -> io::Result<Vec<Sum>> {
    file.set_len(len)?;
    #[cfg(test)]
    tests::FILLS.with(|fills| fills.set(fills.get() + 1));
    let end = values.iter().map(|v| v.offset + v.bytes.len() as u64).max();
    let Some(end) = end.filter(|&e| e > 0) else {
        return Ok(vec![0; values.len()]);
    };
    // A mapping can be refused where writes are not (RLIMIT_AS, vm.max_map_count: the whole
    // file's length in address space): the helper then writes with pwrite(2), as where the
    // kernel cannot populate. Slower, and never a save failed that plain writes finish.
    if end > len {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "values placed past the end of the file",
        ));
    }
    let map = MmapRaw::map_raw(file).ok();
    if map.as_ref().is_some_and(|map| (map.len() as u64) < end) {
        return Err(io::Error::other(
            "the file shrank while it was being written",
        ));
    }
    let claims = Claims {
        ends: Mutex::new((0, values.len())),
        failed: AtomicBool::new(false),
    };
    let target = Target(map.as_ref().map(MmapRaw::as_mut_ptr));
    let (front, back) = std::thread::scope(|scope| {
        // No thread to be had (RLIMIT_NPROC, a cgroup's pids.max): this thread writes it all,
        // as a plain save would, rather than panic as `scope.spawn` does.
        let spawned = writers.helper().then(|| {
            std::thread::Builder::new().spawn_scoped(scope, || {
                // A panic (a bug) is an error of the save, which stops the front writer too.
                let copied = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    #[cfg(test)]
                    assert!(writers != Writers::HelperPanics, "a test's panic");
                    copy_from_the_back(file, &target, values, &claims, after)
                }))
                .unwrap_or_else(|_| Err(io::Error::other("the helper writer panicked")));
                if copied.is_err() {
                    claims.failed.store(true, Ordering::Relaxed);
                }
                copied
            })
        });
        let helper = spawned.and_then(Result::ok);
        let written = if writers.front() || helper.is_none() {
            write_from_the_front(file, values, &claims, after)
        } else {
            Ok(Vec::new())
        };
        if written.is_err() {
            claims.failed.store(true, Ordering::Relaxed);
        }
        let copied = helper.map_or(Ok(Vec::new()), |helper| {
            helper
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("the helper writer panicked")))
        });
        (written, copied)
    });
    let mut sums = vec![0; values.len()];
    for (index, sum) in front?.into_iter().chain(back?) {
        sums[index] = sum;
    }
    Ok(sums)
}

/// Which values are still to be written: `ends.0..ends.1`; the front writer takes from the
/// start, the helper from the end.
struct Claims {
    ends: Mutex<(usize, usize)>,
    failed: AtomicBool,
}

impl Claims {
    /// The next run from the front: values up to [`PIECE`] bytes (at least one), or none left.
    fn front(&self, values: &[Placed<'_>]) -> std::ops::Range<usize> {
        let mut ends = self.ends.lock().unwrap_or_else(|e| e.into_inner());
        let (start, stop) = *ends;
        let mut taken = 0;
        let mut next = start;
        while next < stop && next - start < MAX_IOV && (next == start || taken < PIECE) {
            taken += values[next].bytes.len();
            next += 1;
        }
        ends.0 = next;
        start..next
    }

    /// The next run from the back, as [`Self::front`].
    fn back(&self, values: &[Placed<'_>]) -> std::ops::Range<usize> {
        let mut ends = self.ends.lock().unwrap_or_else(|e| e.into_inner());
        let (stop, end) = *ends;
        let mut taken = 0;
        let mut first = end;
        while first > stop && (first == end || taken < PIECE) {
            first -= 1;
            taken += values[first].bytes.len();
        }
        ends.1 = first;
        first..end
    }

    fn failed(&self) -> bool {
        self.failed.load(Ordering::Relaxed)
    }
}

/// The start of the shared mapping, if the file could be mapped, for the helper thread (which
/// writes only the bytes of the values it claimed, which no one else writes).
struct Target(Option<*mut u8>);

// SAFETY: the pointer is only used for the claimed, disjoint ranges of a mapping that outlives
// the threads (it is unmapped after the scope ends).
unsafe impl Sync for Target {}

/// The front writer: positioned vectored writes of runs of values, summed as they go.
fn write_from_the_front(
    file: &File,
    values: &[Placed<'_>],
    claims: &Claims,
    after: &AfterEachPiece<'_>,
) -> io::Result<Vec<(usize, Sum)>> {
    let mut sums = Vec::new();
    let mut batch: Vec<&[u8]> = Vec::with_capacity(MAX_IOV);
    let (mut at, mut batched) = (0u64, 0usize);
    loop {
        if claims.failed() {
            return Ok(sums); // the helper's error is the one reported
        }
        let run = claims.front(values);
        if run.is_empty() {
            break;
        }
        for index in run {
            let value = values[index];
            let mut sum = Running::default();
            for (k, piece) in value.bytes.chunks(PIECE).enumerate() {
                let offset = value.offset + (k * PIECE) as u64;
                if !batch.is_empty()
                    && (offset != at + batched as u64
                        || batch.len() == MAX_IOV
                        || batched + piece.len() > PIECE)
                {
                    write_batch(file, at, &batch, after)?;
                    batch.clear();
                    batched = 0;
                }
                if batch.is_empty() {
                    at = offset;
                }
                if value.summed {
                    sum.update(piece);
                }
                batch.push(piece);
                batched += piece.len();
            }
            if value.summed {
                sums.push((index, sum.finish()));
            }
        }
    }
    write_batch(file, at, &batch, after)?;
    Ok(sums)
}

/// Writes `slices` back to back from `offset`.
fn write_batch(
    file: &File,
    offset: u64,
    slices: &[&[u8]],
    after: &AfterEachPiece<'_>,
) -> io::Result<()> {
    let total: usize = slices.iter().map(|s| s.len()).sum();
    let mut done = 0;
    while done < total {
        // The slices not yet (wholly) written, the first one cut where the last call stopped.
        let mut skip = done;
        let mut iov = Vec::with_capacity(slices.len());
        for slice in slices {
            if skip >= slice.len() {
                skip -= slice.len();
                continue;
            }
            iov.push(libc::iovec {
                iov_base: slice[skip..].as_ptr() as *mut libc::c_void,
                iov_len: slice.len() - skip,
            });
            skip = 0;
        }
        // SAFETY: the iovecs point into live slices for the call's duration.
        let n = unsafe {
            libc::pwritev(
                file.as_raw_fd(),
                iov.as_ptr(),
                iov.len() as libc::c_int,
                (offset + done as u64) as libc::off_t,
            )
        };
        match n {
            0 => return Err(io::Error::new(io::ErrorKind::WriteZero, "wrote nothing")),
            n if n > 0 => done += n as usize,
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    if total > 0 {
        after.written(file, offset, total as u64);
    }
    Ok(())
}

/// The helper: runs of values from the back, each piece's pages populated (a full filesystem
/// is an error here, not a signal later), summed, then copied into the mapping. Where the
/// kernel cannot populate (before Linux 5.14), or the file could not be mapped, it writes with
/// pwrite(2) instead: correct, and no faster than the front writer.
fn copy_from_the_back(
    file: &File,
    target: &Target,
    values: &[Placed<'_>],
    claims: &Claims,
    after: &AfterEachPiece<'_>,
) -> io::Result<Vec<(usize, Sum)>> {
    let mut sums = Vec::new();
    let mut mapped = target.0.is_some();
    while !claims.failed() {
        let run = claims.back(values);
        if run.is_empty() {
            break;
        }
        for index in run {
            let value = values[index];
            let mut sum = Running::default();
            for (k, piece) in value.bytes.chunks(PIECE).enumerate() {
                let offset = value.offset as usize + k * PIECE;
                // SAFETY: `offset..offset + piece.len()` lies inside the mapping (checked against
                // its length before the threads started) and belongs to this value alone.
                let into = target
                    .0
                    .filter(|_| mapped)
                    .map(|at| unsafe { at.add(offset) });
                if let Some(into) = into {
                    mapped = populate(into, piece.len())?;
                }
                if value.summed {
                    sum.update(piece);
                }
                if let Some(into) = into.filter(|_| mapped) {
                    // SAFETY: as above; the pages are there (populated), and `piece` is the
                    // caller's memory, which no mapping of this file can be.
                    unsafe { std::ptr::copy_nonoverlapping(piece.as_ptr(), into, piece.len()) };
                } else {
                    file.write_all_at(piece, offset as u64)?;
                }
                after.progress.add(piece.len() as u64);
            }
            if value.summed {
                sums.push((index, sum.finish()));
            }
        }
    }
    Ok(sums)
}

/// Faults in, writable, the pages holding `len` bytes from `start` (a shared mapping of a
/// tmpfs file): their allocation fails here, with an error, rather than at a store, as SIGBUS.
/// `false` where the kernel has no such call (the caller writes instead).
fn populate(start: *mut u8, len: usize) -> io::Result<bool> {
    if len == 0 {
        return Ok(true);
    }
    let page = page_size();
    let first = start as usize & !(page - 1);
    let end = (start as usize + len).next_multiple_of(page);
    loop {
        // SAFETY: madvise on pages of our own mapping; POPULATE_WRITE changes no byte.
        let done =
            unsafe { libc::madvise(first as *mut libc::c_void, end - first, MADV_POPULATE_WRITE) };
        if done == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR | libc::EAGAIN) => continue,
            Some(libc::EINVAL | libc::ENOSYS) => return Ok(false),
            // What a store would have met as SIGBUS: no page to be had, which on a file of
            // ours that no one else can truncate (see `pays_for`) is a full filesystem.
            Some(libc::EFAULT) => return Err(io::Error::from_raw_os_error(libc::ENOSPC)),
            _ => return Err(e),
        }
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no side effect.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).unwrap_or(4096).max(4096)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::io::Progress;
    use std::cell::Cell;
    use std::os::unix::fs::PermissionsExt;

    thread_local! {
        /// Calls of [`write_from_both_ends`] on this thread: shows a save took that path.
        pub static FILLS: Cell<usize> = const { Cell::new(0) };
    }

    /// A directory on tmpfs (the machine's /dev/shm), private to this user.
    fn tmpfs_dir() -> tempfile::TempDir {
        let dir =
            tempfile::tempdir_in("/dev/shm").expect("/dev/shm, a tmpfs, is part of the machine");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        dir
    }

    fn file_in(dir: &std::path::Path, mode: u32) -> File {
        let path = dir.join("f");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .unwrap();
        file.set_permissions(std::fs::Permissions::from_mode(mode))
            .unwrap();
        file
    }

    /// Values of every kind of size (empty, tiny, several pieces, runs of more than one
    /// pwritev's slices), some back to back and some with gaps, some summed.
    fn values() -> (Vec<Vec<u8>>, Vec<(u64, bool)>, u64) {
        let mut sizes = vec![
            0,
            1,
            4,
            PIECE + 3,
            7,
            0,
            2 * PIECE,
            60,
            1 << 20,
            3 * PIECE - 1,
        ];
        sizes.extend(std::iter::repeat_n(16, 2 * MAX_IOV + 5));
        sizes.extend([5 * PIECE + 11, 9]);
        let (mut bytes, mut places, mut at) = (Vec::new(), Vec::new(), 0u64);
        for (i, &n) in sizes.iter().enumerate() {
            if i % 3 == 0 {
                at = at.next_multiple_of(64); // a gap, as external data's alignment leaves
            }
            bytes.push((0..n).map(|j| (i * 31 + j * 7) as u8).collect());
            places.push((at, i % 5 != 1));
            at += n as u64;
        }
        (bytes, places, at + 100)
    }

    #[test]
    fn every_value_lands_in_place_with_its_checksum_and_the_gaps_read_zero() {
        let (bytes, places, len) = values();
        let placed: Vec<Placed> = bytes
            .iter()
            .zip(&places)
            .map(|(b, &(offset, summed))| Placed {
                offset,
                bytes: b,
                summed,
            })
            .collect();
        let mut expected = vec![0u8; len as usize];
        for p in &placed {
            expected[p.offset as usize..p.offset as usize + p.bytes.len()].copy_from_slice(p.bytes);
        }
        let writers = [Writers::Both, Writers::FrontOnly, Writers::HelperOnly];
        for (dir, writers) in [tmpfs_dir(), tempfile::tempdir().unwrap()]
            .iter()
            .flat_map(|dir| writers.map(|w| (dir, w)))
        {
            let _ = std::fs::remove_file(dir.path().join("f"));
            let file = file_in(dir.path(), 0o600);
            let progress = Progress::default();
            let after = AfterEachPiece {
                writeback: false,
                progress: &progress,
            };
            let sums = fill(&file, len, &placed, &after, writers).unwrap();
            assert!(std::fs::read(dir.path().join("f")).unwrap() == expected);
            for (p, sum) in placed.iter().zip(&sums) {
                let want = if p.summed {
                    crate::seal::checksums::sum(p.bytes)
                } else {
                    0
                };
                assert_eq!(*sum, want);
            }
            let value_bytes: usize = bytes.iter().map(Vec::len).sum();
            assert_eq!(progress.written(), value_bytes as u64);
        }
    }

    #[test]
    fn only_a_large_private_file_on_tmpfs_with_two_threads_pays() {
        let dir = tmpfs_dir();
        let file = file_in(dir.path(), 0o600);
        assert!(pays_for(&file, MIN_BYTES, 2));
        assert!(!pays_for(&file, MIN_BYTES - 1, 2));
        assert!(!pays_for(&file, MIN_BYTES, 1));
        for open_to_others in [0o620, 0o602, 0o622] {
            file.set_permissions(std::fs::Permissions::from_mode(open_to_others))
                .unwrap();
            assert!(!pays_for(&file, MIN_BYTES, 2), "{open_to_others:o}");
        }
    }

    #[test]
    fn a_panic_of_the_helper_is_an_error_of_the_fill() {
        let (bytes, places, len) = values();
        let placed: Vec<Placed> = bytes
            .iter()
            .zip(&places)
            .map(|(b, &(offset, summed))| Placed {
                offset,
                bytes: b,
                summed,
            })
            .collect();
        let dir = tmpfs_dir();
        let file = file_in(dir.path(), 0o600);
        let progress = Progress::default();
        let after = AfterEachPiece {
            writeback: false,
            progress: &progress,
        };
        let e = fill(&file, len, &placed, &after, Writers::HelperPanics).unwrap_err();
        assert_eq!(e.to_string(), "the helper writer panicked");
    }

    #[test]
    fn values_past_the_end_of_the_file_are_refused_before_a_byte_is_written() {
        let dir = tmpfs_dir();
        let file = file_in(dir.path(), 0o600);
        let bytes = [7u8; 100];
        let placed = [Placed {
            offset: 8000,
            bytes: &bytes,
            summed: true,
        }];
        let progress = Progress::default();
        let after = AfterEachPiece {
            writeback: false,
            progress: &progress,
        };
        let e = fill(&file, 8050, &placed, &after, Writers::Both).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert_eq!(progress.written(), 0);
    }

    #[test]
    fn a_page_that_cannot_be_had_is_an_error_not_a_signal() {
        let dir = tmpfs_dir();
        let file = file_in(dir.path(), 0o600);
        file.set_len(1 << 20).unwrap();
        let map = MmapRaw::map_raw(&file).unwrap();
        assert!(populate(map.as_mut_ptr(), 1 << 20).unwrap());
        // Shrunk under the mapping: a store past the end would be SIGBUS; populating says so.
        file.set_len(4096).unwrap();
        let e = populate(unsafe { map.as_mut_ptr().add(8192) }, 100).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        assert!(populate(map.as_mut_ptr(), 4096).unwrap());
    }

    /// xorshift: layouts that differ from round to round, the same from run to run.
    struct Layouts(u64);

    impl Layouts {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    /// Where the two writers meet, one page may take the front's pwritev for some bytes and the
    /// helper's stores for the rest, either first (the kernel zeroes the rest of a new folio a
    /// write fills in part: under its lock, before any fault can map it). Layouts of values at
    /// odd offsets, of sizes around a page and up to several pieces, gaps or none: every byte
    /// where it belongs, every checksum right. (Probed on tmpfs mounted huge=always and
    /// huge=within_size too, 900 rounds: the same.)
    #[test]
    fn where_the_writers_meet_on_a_page_every_byte_lands_in_place() {
        let dir = tmpfs_dir();
        let mut layouts = Layouts(0x9e37_79b9_7f4a_7c15);
        for round in 0..32 {
            let (mut bytes, mut offsets) = (Vec::new(), Vec::new());
            let mut at = layouts.below(5000);
            for _ in 0..1 + layouts.below(64) {
                let n = match layouts.below(4) {
                    0 => layouts.below(100),
                    1 => 4090 + layouts.below(12),
                    2 => layouts.below(PIECE as u64 + 9000),
                    _ => layouts.below(70_000),
                };
                let seed = layouts.below(251);
                bytes.push(
                    (0..n)
                        .map(|j| (seed + j * 131) as u8 | 1)
                        .collect::<Vec<u8>>(),
                );
                offsets.push(at);
                at += n + layouts.below(2) * layouts.below(9000);
            }
            let len = at + layouts.below(10_000);
            let placed: Vec<Placed> = bytes
                .iter()
                .zip(&offsets)
                .map(|(bytes, &offset)| Placed {
                    offset,
                    bytes,
                    summed: true,
                })
                .collect();
            let mut expected = vec![0u8; len as usize];
            for p in &placed {
                expected[p.offset as usize..p.offset as usize + p.bytes.len()]
                    .copy_from_slice(p.bytes);
            }
            let file = file_in(dir.path(), 0o600);
            let progress = Progress::default();
            let after = AfterEachPiece {
                writeback: false,
                progress: &progress,
            };
            let sums = fill(&file, len, &placed, &after, Writers::Both).unwrap();
            let got = std::fs::read(dir.path().join("f")).unwrap();
            let wrong = got.iter().zip(&expected).position(|(a, b)| a != b);
            assert!(
                got.len() == expected.len() && wrong.is_none(),
                "round {round}: at {wrong:?}"
            );
            for (p, sum) in placed.iter().zip(&sums) {
                assert_eq!(*sum, crate::seal::checksums::sum(p.bytes), "round {round}");
            }
            std::fs::remove_file(dir.path().join("f")).unwrap();
        }
    }
}
