//! Filling a file on tmpfs from both ends at once: this thread writes from the front with
//! positioned writes while a helper thread copies from the back through a shared mapping.
//!
//! Why: tmpfs serialises every write(2) to one file on the inode's lock, so two writer threads
//! take the time of one (measured: two pwrite threads, the same wall time for twice the CPU).
//! Page faults on a shared mapping take no inode lock, so the helper's copies run beside the
//! writes. A page costs the mapping about twice what it costs write(2) (about 1.0 s against
//! 0.46 s a GiB on this project's machine), so the two claim pieces of 256 KiB from their ends
//! and meet where their speeds put them, inside a large value too: no fixed split to tune.
//! Measured in benches/save_vs_write.py.
//!
//! Checksums: each writer sums a value as it goes through it in order, while the bytes are in
//! cache. The helper's runs go backwards, so a value it writes in several runs is summed whole
//! once its first piece is written if it is small (up to `HELPER_SUMS_UP_TO`); a larger one,
//! and the one value where the two meet, are summed after both are done: from the caller's
//! bytes, the ones written.
//!
//! Why only tmpfs, and only a file no one else may write: a store into a mapping whose page
//! cannot be had (a full filesystem, or the file truncated by another process) is SIGBUS, the
//! end of the process, where write(2) returns an error. So the helper first populates each
//! range with `MADV_POPULATE_WRITE`, which answers EFAULT instead (the piece is then written
//! with pwrite(2), whose error is the kernel's own: ENOSPC, EDQUOT), and copies only into pages
//! that are there; on tmpfs nothing takes them away again (no writeback, no block to allocate
//! at the next store). The file must be this user's and closed to the writes of others (no
//! group or other write bit; a directory's default ACL shows in the group bits), so no other
//! user can truncate it under the copy. On disk filesystems a store can still need a new block
//! (copy-on-write, or after writeback), so they keep plain writes.
//!
//! The helper is only ever an extra: where no thread can be started or the file cannot be
//! mapped (RLIMIT_AS), or where it has no core of its own (`OwnCore`), the front writer
//! writes what it did not, as a plain save would.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use memmap2::MmapRaw;

use super::writeback::{AfterEachPiece, PIECE};
use crate::seal::checksums::{self, Running, Sum};

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

/// The largest value whose checksum the helper takes whole, from the caller's bytes, once it
/// has written all of it in several runs: about 6 ms of summing, the longest the front writer
/// may then wait for it at the end; larger ones are left to the caller (see
/// [`copy_from_the_back`]). At 4 MiB, every value of 11 MiB the helper wrote (1 GiB in 96
/// tensors) was summed by the front writer after the helper was done: serial work.
const HELPER_SUMS_UP_TO: usize = 64 << 20;

/// The helper lets go of the pages it copied into every this many bytes (see [`let_go`]).
const LET_GO_EVERY: usize = 8 << 20;

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
/// sees every piece once written. Returns each value's checksum (0 where not `summed`).
///
/// # Errors
/// OS errors of either writer: the first one stops both. A page the helper cannot have (a full
/// tmpfs) is the error a write gets there, never a signal.
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
        return Ok(every_sum(values, std::iter::empty())); // empty values have a checksum too
    };
    if end > len {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "values placed past the end of the file",
        ));
    }
    // A mapping can be refused where writes are not (RLIMIT_AS, vm.max_map_count: it takes the
    // file's length in address space): then there is no helper, and the front writes it all.
    let map = MmapRaw::map_raw(file).ok();
    if map.as_ref().is_some_and(|map| (map.len() as u64) < end) {
        return Err(io::Error::other(
            "the file shrank while it was being written",
        ));
    }
    let pieces = pieces_of(values);
    if u32::try_from(pieces.len()).is_err() {
        return Err(io::Error::other(
            "more than 2^32 pieces (1 PiB) in one file",
        ));
    }
    let claims = Claims::new((0, pieces.len()));
    let target = map.as_ref().map(|map| Target(map.as_mut_ptr()));
    let (front, back) = std::thread::scope(|scope| {
        // No thread to be had (RLIMIT_NPROC, a cgroup's pids.max): no helper, rather than the
        // panic of `scope.spawn`.
        let helper = target
            .as_ref()
            .filter(|_| writers.helper())
            .and_then(|target| {
                let helper = std::thread::Builder::new().spawn_scoped(scope, || {
                    // A panic (a bug) is an error of the save, which stops the front writer too.
                    let copied = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        #[cfg(test)]
                        assert!(writers != Writers::HelperPanics, "a test's panic");
                        copy_from_the_back(
                            file,
                            target,
                            values,
                            &pieces,
                            &claims,
                            after,
                            writers.front(),
                        )
                    }))
                    .unwrap_or_else(|_| Err(io::Error::other("the helper writer panicked")));
                    if copied.is_err() {
                        claims.failed.store(true, Ordering::Relaxed);
                    }
                    copied
                });
                helper.ok()
            });
        let written = if writers.front() || helper.is_none() {
            write_from_the_front(file, values, &pieces, &claims, after)
        } else {
            Ok(Vec::new())
        };
        if written.is_err() {
            claims.failed.store(true, Ordering::Relaxed);
        }
        let copied = helper.map_or(Ok(Vec::new()), |helper| {
            helper.thread().unpark(); // a helper pausing for a core: nothing is left to claim
            helper
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("the helper writer panicked")))
        });
        (written, copied)
    });
    Ok(every_sum(values, front?.into_iter().chain(back?)))
}

/// Each value's checksum (0 where not summed): those the writers took as they went, and the
/// value where the two met, written partly by each, summed here whole.
fn every_sum(values: &[Placed<'_>], taken: impl Iterator<Item = (usize, Sum)>) -> Vec<Sum> {
    let mut sums = vec![None; values.len()];
    for (index, sum) in taken {
        sums[index] = Some(sum);
    }
    values
        .iter()
        .zip(sums)
        .map(|(value, sum)| match sum {
            Some(sum) => sum,
            None if value.summed => checksums::sum(value.bytes),
            None => 0,
        })
        .collect()
}

/// A value's bytes cut into pieces of at most [`PIECE`] bytes (one empty piece for an empty
/// value): the unit the two writers claim, so that they meet inside a large value too.
#[derive(Clone, Copy)]
struct Piece<'a> {
    value: usize,
    offset: u64,
    bytes: &'a [u8],
    first: bool,
    last: bool,
}

fn pieces_of<'a>(values: &[Placed<'a>]) -> Vec<Piece<'a>> {
    let mut pieces = Vec::new();
    for (value, placed) in values.iter().enumerate() {
        let count = placed.bytes.len().div_ceil(PIECE).max(1);
        for k in 0..count {
            let bytes = &placed.bytes[k * PIECE..placed.bytes.len().min((k + 1) * PIECE)];
            pieces.push(Piece {
                value,
                offset: placed.offset + (k * PIECE) as u64,
                bytes,
                first: k == 0,
                last: k + 1 == count,
            });
        }
    }
    pieces
}

/// Which pieces are still to be written, `front..back`, packed in one word: the front writer
/// takes from the start, the helper from the end. Lock-free: a lock the helper held while
/// preempted would stall the front writer.
struct Claims {
    ends: AtomicU64,
    failed: AtomicBool,
}

impl Claims {
    /// `front..back` (piece indices; at most 2^32 pieces, 1 PiB: [`fill`] checks).
    fn new((front, back): (usize, usize)) -> Claims {
        Claims {
            ends: AtomicU64::new(pack(front, back)),
            failed: AtomicBool::new(false),
        }
    }

    /// The next run from the front: pieces up to [`PIECE`] bytes (at least one), or none left.
    fn front(&self, pieces: &[Piece<'_>]) -> std::ops::Range<usize> {
        self.take(|start, stop| {
            let mut taken = 0;
            let mut next = start;
            while next < stop && next - start < MAX_IOV && (next == start || taken < PIECE) {
                taken += pieces[next].bytes.len();
                next += 1;
            }
            (start..next, (next, stop))
        })
    }

    /// The next run from the back, as [`Self::front`].
    fn back(&self, pieces: &[Piece<'_>]) -> std::ops::Range<usize> {
        self.take(|stop, end| {
            let mut taken = 0;
            let mut first = end;
            while first > stop && (first == end || taken < PIECE) {
                first -= 1;
                taken += pieces[first].bytes.len();
            }
            (first..end, (stop, first))
        })
    }

    /// Takes the run `choose` picks from the ends as they are, leaving the ends it returns.
    fn take(
        &self,
        choose: impl Fn(usize, usize) -> (std::ops::Range<usize>, (usize, usize)),
    ) -> std::ops::Range<usize> {
        let mut now = self.ends.load(Ordering::Acquire);
        loop {
            let (front, back) = unpack(now);
            let (run, left) = choose(front, back);
            match self.ends.compare_exchange_weak(
                now,
                pack(left.0, left.1),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return run,
                Err(changed) => now = changed,
            }
        }
    }

    fn failed(&self) -> bool {
        self.failed.load(Ordering::Relaxed)
    }
}

fn pack(front: usize, back: usize) -> u64 {
    ((front as u64) << 32) | back as u64
}

fn unpack(ends: u64) -> (usize, usize) {
    ((ends >> 32) as usize, (ends & u64::from(u32::MAX)) as usize)
}

/// The start of the shared mapping, for the helper thread (which writes only the bytes of the
/// pieces it claimed, which no one else writes).
struct Target(*mut u8);

// SAFETY: the pointer is only used for the claimed, disjoint ranges of a mapping that outlives
// the threads (it is unmapped after the scope ends).
unsafe impl Sync for Target {}

/// A value's checksum taken piece by piece as a writer goes through it in order; complete when
/// the writer reaches its last piece.
#[derive(Default)]
struct InPass(Option<(usize, Running)>);

impl InPass {
    /// Sums `piece` (just before it is written); the value's checksum once it is the last.
    fn see(&mut self, piece: &Piece<'_>, summed: bool) -> Option<(usize, Sum)> {
        if !summed {
            return None;
        }
        if piece.first {
            self.0 = Some((piece.value, Running::default()));
        }
        let (value, running) = self.0.as_mut().filter(|(v, _)| *v == piece.value)?;
        running.update(piece.bytes);
        let done = piece.last.then(|| (*value, running.finish()));
        if done.is_some() {
            self.0 = None;
        }
        done
    }
}

/// The front writer: positioned vectored writes of runs of pieces, each value summed as it
/// goes (all but the one where the writers meet, which the caller sums).
fn write_from_the_front(
    file: &File,
    values: &[Placed<'_>],
    pieces: &[Piece<'_>],
    claims: &Claims,
    after: &AfterEachPiece<'_>,
) -> io::Result<Vec<(usize, Sum)>> {
    let mut sums = Vec::new();
    let mut in_pass = InPass::default();
    let mut batch: Vec<&[u8]> = Vec::with_capacity(MAX_IOV);
    let (mut at, mut batched) = (0u64, 0usize);
    loop {
        if claims.failed() {
            return Ok(sums); // the helper's error is the one reported
        }
        let run = claims.front(pieces);
        if run.is_empty() {
            break;
        }
        for piece in &pieces[run] {
            if !batch.is_empty()
                && (piece.offset != at + batched as u64
                    || batch.len() == MAX_IOV
                    || batched + piece.bytes.len() > PIECE)
            {
                write_batch(file, at, &batch, after)?;
                batch.clear();
                batched = 0;
            }
            if batch.is_empty() {
                at = piece.offset;
            }
            sums.extend(in_pass.see(piece, values[piece.value].summed));
            batch.push(piece.bytes);
            batched += piece.bytes.len();
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

/// The helper: runs of pieces from the back, each piece's pages populated (a full filesystem
/// is an error here, not a signal later), then copied into the mapping. A value inside one run
/// is summed as it goes; one spread over several (the helper's runs go backwards) is summed
/// whole once its first piece is written, from the caller's bytes. Where the kernel cannot
/// populate (before Linux 5.14) it writes with pwrite(2) instead: correct, and no faster than
/// the front writer. It pauses when it has no core of its own ([`OwnCore`]) and `may_pause`
/// (the front writer meanwhile writes what is left).
fn copy_from_the_back(
    file: &File,
    target: &Target,
    values: &[Placed<'_>],
    pieces: &[Piece<'_>],
    claims: &Claims,
    after: &AfterEachPiece<'_>,
    may_pause: bool,
) -> io::Result<Vec<(usize, Sum)>> {
    let mut sums = Vec::new();
    let mut populates = true; // (false: a kernel before 5.14; this run is finished, then no more)
    let mut held = (usize::MAX, 0); // the part of the mapping this helper mapped in, not let go
    let mut core = OwnCore::new();
    let mut pause = OwnCore::FIRST_PAUSE;
    while !claims.failed() && populates {
        match core.still_own() {
            Some(false) if may_pause => {
                // Sharing a core: pause (longer each time, until a window on a core of its
                // own), leaving the pieces to the front writer, which wakes it when none is left.
                std::thread::park_timeout(pause);
                pause = (pause * 2).min(OwnCore::LONGEST_PAUSE);
                core = OwnCore::new(); // the pause is no part of the next window
                continue;
            }
            Some(_) => pause = OwnCore::FIRST_PAUSE,
            None => {}
        }
        let run = claims.back(pieces);
        if run.is_empty() {
            break;
        }
        let mut in_pass = InPass::default();
        for piece in &pieces[run] {
            let (offset, len) = (piece.offset as usize, piece.bytes.len());
            // SAFETY: `offset..offset + len` lies inside the mapping (checked against its
            // length before the threads started) and belongs to this piece alone.
            let into = unsafe { target.0.add(offset) };
            let there = match populates.then(|| populate(into, len)) {
                Some(Ok(Populated::Yes)) => true,
                Some(Ok(Populated::Unsupported)) => {
                    populates = false;
                    false
                }
                // No page to be had: written instead, so that the error is the kernel's own
                // (ENOSPC, EDQUOT), or none if room was made meanwhile.
                Some(Ok(Populated::Refused)) | None => false,
                Some(Err(e)) => return Err(e),
            };
            sums.extend(in_pass.see(piece, values[piece.value].summed));
            if there {
                // SAFETY: as above; the pages are there (populated), and the piece is the
                // caller's memory, which no mapping of this file can be.
                unsafe { std::ptr::copy_nonoverlapping(piece.bytes.as_ptr(), into, len) };
            } else {
                file.write_all_at(piece.bytes, piece.offset)?;
            }
            after.progress.add(len as u64);
            core.did(len);
            held = (held.0.min(offset), held.1.max(offset + len));
        }
        if held.1.saturating_sub(held.0) >= LET_GO_EVERY {
            let_go(target, held);
            held = (usize::MAX, 0);
        }
        // A value begun in this run and not ended in it: its later pieces were this helper's
        // earlier runs, so it is all written now. Summed here if small; a large one is summed
        // by the caller (the front writer must not wait on this helper for long).
        if let InPass(Some((value, _))) = in_pass {
            let bytes = values[value].bytes;
            if bytes.len() <= HELPER_SUMS_UP_TO {
                sums.push((value, checksums::sum(bytes)));
            }
        }
    }
    Ok(sums)
}

/// Whether the helper has a core of its own, judged over each window of its work: its thread's
/// CPU time against the wall time. Where no core is idle, the helper takes its share of a core
/// the front writer needs and spends it on page faults, which cost twice a write's work per
/// page (measured: 0.70x `write()` with the other core busy, where the front writer alone ran
/// at 0.95x), so it pauses and leaves the pieces to the front. It pauses rather than stops: a
/// window can be shared for a moment (the new thread placed on the front's core, a kernel
/// thread), and a helper that stopped for good made rounds bimodal.
struct OwnCore {
    wall: std::time::Instant,
    cpu: std::time::Duration,
    bytes: usize,
}

impl OwnCore {
    /// Bytes of work in one window.
    const WINDOW: usize = 8 << 20;
    const FIRST_PAUSE: std::time::Duration = std::time::Duration::from_millis(1);
    const LONGEST_PAUSE: std::time::Duration = std::time::Duration::from_millis(32);

    fn new() -> OwnCore {
        OwnCore {
            wall: std::time::Instant::now(),
            cpu: thread_cpu_time(),
            bytes: 0,
        }
    }

    fn did(&mut self, bytes: usize) {
        self.bytes += bytes;
    }

    /// At the end of each window (and then a new one starts): whether the helper ran at least
    /// 3/4 of the wall time since the last. `None` within a window.
    fn still_own(&mut self) -> Option<bool> {
        if self.bytes < Self::WINDOW {
            return None;
        }
        let cpu = thread_cpu_time().saturating_sub(self.cpu);
        let own = cpu * 4 >= self.wall.elapsed() * 3;
        *self = OwnCore::new();
        Some(own)
    }
}

/// The calling thread's CPU time.
fn thread_cpu_time() -> std::time::Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime fills the struct it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
    std::time::Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
}

/// Unmaps (MADV_DONTNEED) the pages of `range` of the mapping: on a shared mapping that drops
/// only this process's page-table entries, never a byte of the file. Without it the pages the
/// helper copied into would count in the process's resident size until the save ends, as if
/// the save held a copy of the file (they are the file's own pages, there either way).
fn let_go(target: &Target, (low, high): (usize, usize)) {
    let page = page_size();
    let first = low & !(page - 1);
    let end = high.next_multiple_of(page);
    // SAFETY: madvise on pages of our own shared mapping, which nothing reads through.
    unsafe {
        libc::madvise(target.0.add(first).cast(), end - first, libc::MADV_DONTNEED);
    }
}

/// What [`populate`] found.
#[derive(Debug, PartialEq, Eq)]
enum Populated {
    /// The pages are there, writable.
    Yes,
    /// Not all of them can be had: what a store would have met as SIGBUS (a full filesystem, a
    /// quota, the file shrunk).
    Refused,
    /// The kernel has no such call (before Linux 5.14).
    Unsupported,
}

/// Faults in, writable, the pages holding `len` bytes from `start` (a shared mapping of a
/// tmpfs file): their allocation fails here, with an answer, rather than at a store, as SIGBUS.
fn populate(start: *mut u8, len: usize) -> io::Result<Populated> {
    if len == 0 {
        return Ok(Populated::Yes);
    }
    let page = page_size();
    let first = start as usize & !(page - 1);
    let end = (start as usize + len).next_multiple_of(page);
    loop {
        // SAFETY: madvise on pages of our own mapping; POPULATE_WRITE changes no byte.
        let done =
            unsafe { libc::madvise(first as *mut libc::c_void, end - first, MADV_POPULATE_WRITE) };
        if done == 0 {
            return Ok(Populated::Yes);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR | libc::EAGAIN) => continue,
            Some(libc::EINVAL | libc::ENOSYS) => return Ok(Populated::Unsupported),
            Some(libc::EFAULT) => return Ok(Populated::Refused),
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

    fn after_for(progress: &Progress) -> AfterEachPiece<'_> {
        AfterEachPiece {
            writeback: false,
            progress,
        }
    }

    fn placed_from<'a>(bytes: &'a [Vec<u8>], places: &[(u64, bool)]) -> Vec<Placed<'a>> {
        bytes
            .iter()
            .zip(places)
            .map(|(bytes, &(offset, summed))| Placed {
                offset,
                bytes,
                summed,
            })
            .collect()
    }

    /// The file `placed` should make: their bytes where they go, zeros between.
    fn expected_file(placed: &[Placed<'_>], len: u64) -> Vec<u8> {
        let mut expected = vec![0u8; len as usize];
        for p in placed {
            expected[p.offset as usize..][..p.bytes.len()].copy_from_slice(p.bytes);
        }
        expected
    }

    /// The file at `path` is `expected` and `sums` are the checksums of the summed values (0 of
    /// the others).
    fn assert_written(
        path: &std::path::Path,
        expected: &[u8],
        placed: &[Placed<'_>],
        sums: &[Sum],
        what: &str,
    ) {
        let got = std::fs::read(path).unwrap();
        if got != expected {
            let wrong = got.iter().zip(expected).position(|(a, b)| a != b);
            panic!("{what}: {} bytes, first wrong at {wrong:?}", got.len());
        }
        for (p, sum) in placed.iter().zip(sums) {
            let want = if p.summed { checksums::sum(p.bytes) } else { 0 };
            assert_eq!(*sum, want, "{what}");
        }
    }

    #[test]
    fn every_value_lands_in_place_with_its_checksum_and_the_gaps_read_zero() {
        let (bytes, places, len) = values();
        let placed = placed_from(&bytes, &places);
        let expected = expected_file(&placed, len);
        let writers = [Writers::Both, Writers::FrontOnly, Writers::HelperOnly];
        for (dir, writers) in [tmpfs_dir(), tempfile::tempdir().unwrap()]
            .iter()
            .flat_map(|dir| writers.map(|w| (dir, w)))
        {
            let _ = std::fs::remove_file(dir.path().join("f"));
            let file = file_in(dir.path(), 0o600);
            let progress = Progress::default();
            let after = after_for(&progress);
            let sums = fill(&file, len, &placed, &after, writers).unwrap();
            assert_written(&dir.path().join("f"), &expected, &placed, &sums, "");
            let value_bytes: usize = bytes.iter().map(Vec::len).sum();
            assert_eq!(progress.written(), value_bytes as u64);
        }
    }

    /// The writers meeting at every kind of place: inside a large value, at a value's edge, in a
    /// run of small ones, at either end. The helper writes its part first, then the front.
    #[test]
    fn wherever_the_writers_meet_every_byte_and_checksum_is_right() {
        let (bytes, places, len) = values();
        let placed = placed_from(&bytes, &places);
        let pieces = pieces_of(&placed);
        let dir = tmpfs_dir();
        let progress = Progress::default();
        let after = after_for(&progress);
        let meetings = [
            0,
            1,
            3,
            4,
            5,
            7,
            9,
            12,
            13,
            20,
            100,
            pieces.len() - 3,
            pieces.len(),
        ];
        for meet in meetings {
            let _ = std::fs::remove_file(dir.path().join("f"));
            let file = file_in(dir.path(), 0o600);
            file.set_len(len).unwrap();
            let map = MmapRaw::map_raw(&file).unwrap();
            let target = Target(map.as_mut_ptr());
            let helper = Claims::new((meet, pieces.len()));
            let back = copy_from_the_back(&file, &target, &placed, &pieces, &helper, &after, false);
            let front =
                write_from_the_front(&file, &placed, &pieces, &Claims::new((0, meet)), &after);
            let sums = every_sum(&placed, front.unwrap().into_iter().chain(back.unwrap()));
            let expected = expected_file(&placed, len);
            assert_written(
                &dir.path().join("f"),
                &expected,
                &placed,
                &sums,
                &format!("meet at {meet}"),
            );
        }
    }

    #[test]
    fn a_helper_that_gets_no_core_of_its_own_is_told_so() {
        let mut core = OwnCore::new();
        core.did(OwnCore::WINDOW - 1);
        assert_eq!(core.still_own(), None, "judged only at a window's end");
        core.did(OwnCore::WINDOW);
        std::thread::sleep(std::time::Duration::from_millis(30)); // no CPU time for 30 ms
        assert_eq!(core.still_own(), Some(false));
        assert_eq!(core.still_own(), None, "a new window");
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
        let placed = placed_from(&bytes, &places);
        let dir = tmpfs_dir();
        let file = file_in(dir.path(), 0o600);
        let progress = Progress::default();
        let after = after_for(&progress);
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
        let after = after_for(&progress);
        let e = fill(&file, 8050, &placed, &after, Writers::Both).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert_eq!(progress.written(), 0);
    }

    #[test]
    fn a_page_that_cannot_be_had_is_refused_not_a_signal() {
        let dir = tmpfs_dir();
        let file = file_in(dir.path(), 0o600);
        file.set_len(1 << 20).unwrap();
        let map = MmapRaw::map_raw(&file).unwrap();
        assert_eq!(populate(map.as_mut_ptr(), 1 << 20).unwrap(), Populated::Yes);
        // Shrunk under the mapping: a store past the end would be SIGBUS; populating says so.
        file.set_len(4096).unwrap();
        let past = unsafe { map.as_mut_ptr().add(8192) };
        assert_eq!(populate(past, 100).unwrap(), Populated::Refused);
        assert_eq!(populate(map.as_mut_ptr(), 4096).unwrap(), Populated::Yes);
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
            let expected = expected_file(&placed, len);
            let file = file_in(dir.path(), 0o600);
            let progress = Progress::default();
            let sums = fill(&file, len, &placed, &after_for(&progress), Writers::Both).unwrap();
            assert_written(
                &dir.path().join("f"),
                &expected,
                &placed,
                &sums,
                &format!("round {round}"),
            );
            std::fs::remove_file(dir.path().join("f")).unwrap();
        }
    }

    /// Nothing but empty values (an empty checkpoint, or one whose values are all holes): a
    /// summed one still gets the checksum of no bytes, which is not 0.
    #[test]
    fn empty_values_alone_get_the_checksum_of_no_bytes() {
        assert_ne!(crate::seal::checksums::sum(&[]), 0);
        let dir = tmpfs_dir();
        let progress = Progress::default();
        for len in [0, 100] {
            let _ = std::fs::remove_file(dir.path().join("f"));
            let file = file_in(dir.path(), 0o600);
            let placed = [
                Placed {
                    offset: 0,
                    bytes: &[],
                    summed: true,
                },
                Placed {
                    offset: 0,
                    bytes: &[],
                    summed: false,
                },
            ];
            let sums = fill(&file, len, &placed, &after_for(&progress), Writers::Both).unwrap();
            assert_eq!(sums, [crate::seal::checksums::sum(&[]), 0], "len {len}");
            assert_eq!(file.metadata().unwrap().len(), len);
        }
    }

    /// A file of one piece, which either writer may take (raced many times), and one of two.
    #[test]
    fn a_file_of_one_or_two_pieces_is_whole_whoever_takes_them() {
        let dir = tmpfs_dir();
        let progress = Progress::default();
        let bytes: Vec<u8> = (0..PIECE + 1).map(|i| (i * 13) as u8 | 1).collect();
        for (n, round) in [PIECE, 5, PIECE + 1]
            .into_iter()
            .flat_map(|n| (0..40).map(move |r| (n, r)))
        {
            let _ = std::fs::remove_file(dir.path().join("f"));
            let file = file_in(dir.path(), 0o600);
            let placed = [Placed {
                offset: 3,
                bytes: &bytes[..n],
                summed: true,
            }];
            let sums = fill(
                &file,
                n as u64 + 7,
                &placed,
                &after_for(&progress),
                Writers::Both,
            )
            .unwrap();
            let got = std::fs::read(dir.path().join("f")).unwrap();
            assert!(
                got[..3] == [0; 3] && got[3..3 + n] == bytes[..n] && got[3 + n..] == [0; 4],
                "{n} {round}"
            );
            assert_eq!(
                sums,
                [crate::seal::checksums::sum(&bytes[..n])],
                "{n} {round}"
            );
        }
    }

    /// The helper lets go of its pages every [`LET_GO_EVERY`] bytes, rounded out to whole pages,
    /// so pages the front wrote (by pwrite, before or after) or the helper will write next are
    /// let go too: not a byte lost, wherever the two meet, in either order and together.
    #[test]
    fn letting_go_of_the_helpers_pages_loses_no_byte() {
        let dir = tmpfs_dir();
        // Odd sizes and offsets, so that pieces and values share pages; over 2 x LET_GO_EVERY.
        let sizes = [LET_GO_EVERY + 4097, 3, PIECE - 5, 4093, LET_GO_EVERY + 77];
        let bytes: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|j| (j * 7 + i * 61) as u8 | 1).collect())
            .collect();
        let mut at = 1;
        let placed: Vec<Placed> = bytes
            .iter()
            .map(|b| {
                let p = Placed {
                    offset: at,
                    bytes: b,
                    summed: b.len() < LET_GO_EVERY, // (large ones unsummed: a debug build's xxh3 is slow)
                };
                at += b.len() as u64;
                p
            })
            .collect();
        let len = at + 11;
        let expected = expected_file(&placed, len);
        let pieces = pieces_of(&placed);
        let progress = Progress::default();
        let after = after_for(&progress);
        let check = |sums: Vec<Sum>, what: &str| {
            assert_written(&dir.path().join("f"), &expected, &placed, &sums, what)
        };
        for meet in [0, 33, pieces.len() / 2, pieces.len() - 1] {
            for helper_first in [true, false] {
                let _ = std::fs::remove_file(dir.path().join("f"));
                let file = file_in(dir.path(), 0o600);
                file.set_len(len).unwrap();
                let map = MmapRaw::map_raw(&file).unwrap();
                let target = Target(map.as_mut_ptr());
                let back = || {
                    let claims = Claims::new((meet, pieces.len()));
                    copy_from_the_back(&file, &target, &placed, &pieces, &claims, &after, false)
                };
                let front = || {
                    let claims = Claims::new((0, meet));
                    write_from_the_front(&file, &placed, &pieces, &claims, &after)
                };
                let (front, back) = if helper_first {
                    let back = back();
                    (front(), back)
                } else {
                    (front(), back())
                };
                let sums = every_sum(&placed, front.unwrap().into_iter().chain(back.unwrap()));
                check(sums, &format!("meet {meet}, helper first {helper_first}"));
            }
        }
        for round in 0..2 {
            let _ = std::fs::remove_file(dir.path().join("f"));
            let file = file_in(dir.path(), 0o600);
            let sums = fill(&file, len, &placed, &after, Writers::Both).unwrap();
            check(sums, &format!("both, round {round}"));
        }
    }
}
