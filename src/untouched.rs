//! Which values in this process's memory are, proven, the bytes a checkpoint already keeps: a
//! trainer's frozen arrays, saved step after step, need not be compared with the previous step
//! when no page of theirs was written since that step read them.
//!
//! The proof ([`io::page_watch`]): a save protects the pages of each value before it reads them
//! ([`arm`]); once it has committed, it records where each value it watched now is in a data
//! file (the file as it is then, [`DataFile`], and the offset) if no page of the value was
//! written meanwhile ([`record`]). A later save whose value has the same address and length,
//! no page of which was written since, and whose previous checkpoint keeps that value at that
//! very place, holds the recorded bytes: it compares only the part pages of either end, which
//! the watch does not cover ([`Armed::proves`]).
//!
//! Only values found unchanged at a save ([`settle`]: steady ones, a frozen part) are watched
//! from the next save on: a value that changes every step is never protected, so its writes
//! never fault and its huge pages are never split.
//!
//! What is kept is per process, behind one lock. A scan that protects pages again takes away
//! the record that they were written: it forgets every record those pages overlap, and a save
//! records nothing if another took such a record after its own arm. Memory freed and allocated
//! again between saves is the kernel's to report: its new owner writes it, or it is given back
//! and reads as zeros (a page with no page table counts as written: `PageWatch::open` checks the
//! kernel says so), or it is a new mapping, which is not watched (no answer).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::io::page_watch::{pinned_memory, PageWatch, PrivateAnon};
use crate::seal::pairing::PairId;

/// Where a checkpoint keeps a value: its data file and the offset there.
pub type Origin = (DataFile, u64);

/// A data file as a record names it: its pair id, and the file itself as it was then (device,
/// inode, length, modification time). A pair id alone would not do: the file may since have
/// been written in place (through another link to it) or replaced by an altered copy, trailer
/// and all, and a value proven unwritten would then be saved as those bytes, step after step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DataFile {
    pub pair: PairId,
    stamp: [i64; 5],
}

impl DataFile {
    /// The data file of pair id `pair` whose metadata (of the open file) is `meta`.
    pub fn of(pair: PairId, meta: &std::fs::Metadata) -> DataFile {
        use std::os::unix::fs::MetadataExt;
        DataFile {
            pair,
            stamp: [
                meta.dev() as i64,
                meta.ino() as i64,
                meta.size() as i64,
                meta.mtime(),
                meta.mtime_nsec(),
            ],
        }
    }
}

/// A value's bytes in memory: (address, length).
pub type Span = (usize, usize);

/// Values smaller than this are compared (a few pages: the watch would save little).
pub const MIN_WATCHED_BYTES: usize = 64 * 1024;
/// At most this many values are watched (each is a mapping of its own to the kernel).
const MAX_WATCHED: usize = 4096;

#[derive(Default)]
struct Registry {
    opened: bool,
    watch: Option<PageWatch>,
    /// Values not written since a save recorded where a data file keeps their bytes.
    recorded: HashMap<Span, Origin>,
    /// Values the last comparing save found unchanged: the ones the next save watches.
    steady: HashSet<Span>,
    /// The page ranges watched now. Each is a mapping of its own to the kernel (watching splits
    /// the one it lies in): those no save wants any more are unwatched, so that a run whose
    /// arrays come and go does not pile mappings up towards the kernel's limit.
    watched: HashSet<(usize, usize)>,
    /// Scans that found pages written and protected them again: taken records of writes.
    takings: u64,
}

static REGISTRY: Mutex<Option<Registry>> = Mutex::new(None);

/// The process whose registry this is (0: none has used it yet).
static OWNER: AtomicU32 = AtomicU32::new(0);

/// Whether the registry is this process's: not in a forked child of the process that used it.
/// The child must never take the lock: a thread of its parent may have held it when it forked
/// (a save of another thread, arming), and the child would wait for it forever. (It has no
/// watch of its own either: the parent's registrations and records are not its.)
fn this_process_watches() -> bool {
    let me = std::process::id();
    match OWNER.compare_exchange(0, me, Ordering::SeqCst, Ordering::SeqCst) {
        Ok(_) => true,
        Err(owner) => owner == me,
    }
}

/// The registry, `None` in a forked child (see [`this_process_watches`]).
fn registry() -> Option<MutexGuard<'static, Option<Registry>>> {
    // A panic while it was held leaves nothing half-done that matters: records only ever
    // shrink to be safe, so a poisoned lock's content is still sound.
    this_process_watches().then(|| {
        REGISTRY
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    })
}

/// What one save armed: the values it protected before reading them, and the records still
/// standing for them.
#[derive(Debug, Default)]
pub struct Armed {
    armed: HashSet<Span>,
    standing: HashMap<Span, Origin>,
    takings: u64,
    page: usize,
}

impl Armed {
    /// Whether no value was armed (then the save has nothing to record).
    pub fn is_empty(&self) -> bool {
        self.armed.is_empty()
    }

    /// For `bytes` (a value of the save that armed this), found where the previous checkpoint
    /// keeps it (`origin`): the whole pages `[start, end)` of it that are proven those bytes,
    /// leaving the parts before and after for the caller to compare. `None`: not proven.
    pub fn proves(&self, bytes: &[u8], origin: Origin) -> Option<(usize, usize)> {
        let span = (bytes.as_ptr() as usize, bytes.len());
        if self.standing.get(&span) != Some(&origin) {
            return None;
        }
        let first = span.0;
        let start = first.checked_add(self.page - 1)? & !(self.page - 1);
        let end = first.checked_add(bytes.len())? & !(self.page - 1);
        (start < end).then_some((start - first, end - first))
    }
}

/// Protects the pages of `values` (those of [`MIN_WATCHED_BYTES`] or more, in private
/// anonymous memory) before a save reads them, and says which records still stand for them.
/// `None` where the kernel offers no watch (the save compares as it always did).
pub fn arm<'a>(values: impl Iterator<Item = &'a [u8]>) -> Option<Armed> {
    let mut guard = registry()?;
    let registry = guard.get_or_insert_with(Registry::default);
    if !registry.opened {
        registry.opened = true;
        registry.watch = PageWatch::open();
    }
    let Registry {
        watch,
        recorded,
        steady,
        watched,
        takings,
        ..
    } = registry;
    let watch = watch.as_ref().filter(|w| w.is_ours())?;
    let page = watch.page();
    let mut armed = Armed {
        page,
        ..Armed::default()
    };
    let mut wanted: Vec<(Span, (usize, usize))> = Vec::new();
    let mut seen = HashSet::new();
    for bytes in values {
        if bytes.len() < MIN_WATCHED_BYTES || wanted.len() >= MAX_WATCHED {
            continue;
        }
        let span = (bytes.as_ptr() as usize, bytes.len());
        if !steady.contains(&span) || !seen.insert(span) {
            continue;
        }
        if let Some(pages) = watch.pages_within(bytes) {
            wanted.push((span, pages));
        }
    }
    // Ranges no value of this save lies on are unwatched first (their records forgotten: the
    // memory is no longer protected), then this save's are watched.
    let keep: HashSet<(usize, usize)> = wanted.iter().map(|(_, pages)| *pages).collect();
    let stale: Vec<(usize, usize)> = watched.difference(&keep).copied().collect();
    for &(start, end) in &stale {
        watch.unwatch(start, end);
        watched.remove(&(start, end));
    }
    forget_overlapping(recorded, &stale, page);
    if wanted.is_empty() {
        return Some(armed); // (nothing steady: no proc file to read)
    }
    if pinned_memory() {
        // A write through a pin is never seen: no record can be trusted while one is held.
        recorded.clear();
        return None;
    }
    let anon = PrivateAnon::read().filter(|anon| anon.room_for(3 * wanted.len()))?;
    for (span, (start, end)) in wanted {
        watched.insert((start, end));
        match watch.take_written(start, end, &anon) {
            None => {
                forget_overlapping(recorded, &[(start, end)], page);
                steady.remove(&span);
            }
            Some(written) => {
                if !written.is_empty() {
                    *takings += 1;
                    forget_overlapping(recorded, &written, page);
                }
                armed.armed.insert(span);
            }
        }
    }
    for span in &armed.armed {
        if let Some(origin) = recorded.get(span) {
            armed.standing.insert(*span, *origin);
        }
    }
    armed.takings = *takings;
    Some(armed)
}

/// Whether no value is steady: the next save would watch nothing, so it need not look at its
/// values (only say it is armed, for the comparison to settle what it finds).
pub fn nothing_steady() -> bool {
    registry().is_none_or(|guard| guard.as_ref().is_none_or(|r| r.steady.is_empty()))
}

/// What a save found: its `equal` values (unchanged since the previous checkpoint, compared or
/// proven) are the ones the next save watches, and no others (a run whose arrays come and go
/// keeps no stale ones).
pub fn settle<'a>(equal: impl Iterator<Item = &'a [u8]>) {
    let Some(mut guard) = registry() else {
        return;
    };
    let Some(registry) = guard.as_mut() else {
        return;
    };
    registry.steady = equal
        .filter(|b| b.len() >= MIN_WATCHED_BYTES)
        .map(|b| (b.as_ptr() as usize, b.len()))
        .take(MAX_WATCHED)
        .collect();
}

/// After the save that armed `armed` committed: records `stored` (each value's bytes and where
/// the committed checkpoint keeps them in its data file) for the values it armed that no page
/// of was written since. Records nothing if another save took a record of writes meanwhile.
pub fn record<'a>(armed: &Armed, stored: impl Iterator<Item = (&'a [u8], Origin)>) {
    let Some(mut guard) = registry() else {
        return;
    };
    let Some(registry) = guard.as_mut() else {
        return;
    };
    let Some(watch) = registry.watch.as_ref().filter(|w| w.is_ours()) else {
        return;
    };
    if registry.takings != armed.takings {
        return;
    }
    let mut found = Vec::new();
    for (bytes, origin) in stored {
        let span = (bytes.as_ptr() as usize, bytes.len());
        if !armed.armed.contains(&span) {
            continue;
        }
        let Some((start, end)) = watch.pages_within(bytes) else {
            continue;
        };
        if watch.written(start, end).is_some_and(|w| w.is_empty()) {
            found.push((span, origin));
        } else {
            registry.recorded.remove(&span);
        }
    }
    for (span, origin) in found {
        if registry.recorded.len() < MAX_WATCHED || registry.recorded.contains_key(&span) {
            registry.recorded.insert(span, origin);
        }
    }
}

/// The values recorded now.
#[cfg(test)]
fn recorded() -> Vec<Span> {
    registry()
        .and_then(|guard| {
            let keys = guard.as_ref()?.recorded.keys().copied().collect();
            Some(keys)
        })
        .unwrap_or_default()
}

/// Forgets every record whose pages overlap one of `regions` (page-aligned spans).
fn forget_overlapping(
    recorded: &mut HashMap<Span, Origin>,
    regions: &[(usize, usize)],
    page: usize,
) {
    recorded.retain(|&(address, len), _| {
        let (start, end) = (address & !(page - 1), address.saturating_add(len));
        !regions.iter().any(|&(a, b)| a < end && start < b)
    });
}

/// Held by each test that arms: the registry is the process's, tests run on its threads, and
/// one's arm taking a record of writes makes another's record nothing.
#[cfg(test)]
pub(crate) static TEST_SERIAL: Mutex<()> = Mutex::new(());

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_is_proven_until_a_page_of_it_is_written() {
        let _serial = TEST_SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let mut frozen = vec![3u8; 40 * 4096 + 123];
        let other = vec![5u8; 20 * 4096];
        let pair = DataFile {
            pair: [9; 16],
            stamp: [1, 2, 3, 4, 5],
        };
        let span = |v: &[u8]| (v.as_ptr() as usize, v.len());
        let record_of = |v: &[u8]| recorded().contains(&span(v));

        // Not yet found unchanged by any save: not watched.
        let armed = arm([&frozen[..], &other[..]].into_iter()).expect("a watch");
        assert!(armed.armed.is_empty());
        settle([&frozen[..], &other[..]].into_iter());

        // Found unchanged: watched from the next save, recorded once it commits.
        let armed = arm([&frozen[..], &other[..]].into_iter()).unwrap();
        assert!(armed.proves(&frozen, (pair, 64)).is_none()); // nothing recorded yet
        record(
            &armed,
            [(&frozen[..], (pair, 64)), (&other[..], (pair, 999_999))].into_iter(),
        );
        assert!(record_of(&frozen) && record_of(&other));

        let armed = arm([&frozen[..]].into_iter()).unwrap();
        // A value no save wants any more is unwatched (its mapping given back to the kernel).
        let guard = registry().unwrap();
        let watch = guard.as_ref().unwrap().watch.as_ref().unwrap();
        let (a, b) = watch.pages_within(&other).unwrap();
        assert_eq!(watch.written(a, b), None);
        drop(guard);
        assert!(!record_of(&other));
        let (start, end) = armed.proves(&frozen, (pair, 64)).expect("proven");
        assert!(start < 4096 && frozen.len() - end < 4096);
        assert!(armed.proves(&frozen, (pair, 65)).is_none()); // not where the record says
        let elsewhere = DataFile {
            pair: [8; 16],
            ..pair
        };
        assert!(armed.proves(&frozen, (elsewhere, 64)).is_none()); // nor in that data file
                                                                   // Nor in the same pair's file changed (or replaced) since.
        let changed = DataFile {
            stamp: [1, 2, 3, 4, 6],
            ..pair
        };
        assert!(armed.proves(&frozen, (changed, 64)).is_none());
        record(&armed, [(&frozen[..], (pair, 64))].into_iter());

        frozen[20 * 4096] ^= 1; // written: proven no more, and never again by this record
        let armed = arm([&frozen[..]].into_iter()).unwrap();
        assert!(armed.proves(&frozen, (pair, 64)).is_none());
        assert!(!record_of(&frozen));
        // Found different by that save's comparison: watched no more.
        settle(std::iter::empty());
        assert!(arm([&frozen[..]].into_iter()).unwrap().armed.is_empty());

        // A value written between its arm and the record is not recorded.
        settle([&frozen[..]].into_iter());
        let armed = arm([&frozen[..]].into_iter()).unwrap();
        frozen[30 * 4096] ^= 1;
        record(&armed, [(&frozen[..], (pair, 64))].into_iter());
        assert!(!record_of(&frozen));
    }

    #[test]
    fn a_forked_child_never_waits_for_the_lock_its_parent_held() {
        let _serial = TEST_SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let frozen = vec![3u8; 40 * 4096];
        let _ = arm([&frozen[..]].into_iter()); // (this process's registry from here on)
                                                // Held as another thread's save holds it while it arms, when this one forks.
        let held = registry().unwrap();
        // SAFETY: the child only calls what is tested (which takes no lock but the registry's:
        // glibc's fork leaves the allocator's usable) and exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: the alarm ends a child that waits (the failure), _exit ends it otherwise.
            unsafe { libc::alarm(20) };
            settle(std::iter::empty());
            let none = arm([&frozen[..]].into_iter()).is_none() && recorded().is_empty();
            unsafe { libc::_exit(if none { 0 } else { 1 }) };
        }
        drop(held);
        let mut status = 0;
        // SAFETY: waits for the child forked above.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the child waited or failed: {status:#x}"
        );
    }
}
