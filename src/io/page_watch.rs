//! Which pages of this process's private memory were written since it last looked.
//!
//! Linux's userfaultfd write protection in its asynchronous mode (kernel 6.7+): no fault
//! handler runs; the kernel lifts a page's protection on the first write to it and its page
//! table records that it did. The `PAGEMAP_SCAN` ioctl reads those records and, in the same
//! step, protects the pages it found written again. No privileges are needed: the descriptor is
//! opened for faults from user mode only (`UFFD_USER_MODE_ONLY`), and the asynchronous mode
//! resolves every write, the kernel's own included, without one. Soft-dirty bits would say the
//! same on kernels built with them; not every kernel is (this machine's is not).
//!
//! Only private anonymous memory is watched: a shared or file mapping can change without this
//! process writing it. What the page tables cannot see is not seen either: a device writing by
//! DMA into pages pinned for it (RDMA memory regions, io_uring's fixed buffers). Anything this
//! cannot do or read proves nothing (`None`).

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// `_IOC(read|write, type, nr, size)` as Linux's generic ioctl encoding (x86-64, AArch64).
const fn iowr(kind: u8, nr: u8, size: usize) -> libc::c_ulong {
    ((3 << 30)
        | ((size as libc::c_ulong) << 16)
        | ((kind as libc::c_ulong) << 8)
        | nr as libc::c_ulong) as libc::c_ulong
}

const UFFD_API: u64 = 0xAA;
const UFFD_USER_MODE_ONLY: libc::c_int = 1;
const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;
const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioRegister {
    start: u64,
    len: u64,
    mode: u64,
    ioctls: u64,
}

/// `struct pm_scan_arg` (linux/fs.h).
#[repr(C)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

/// `struct page_region`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct PageRegion {
    start: u64,
    end: u64,
    categories: u64,
}

const UFFDIO_API: libc::c_ulong = iowr(0xAA, 0x3F, std::mem::size_of::<UffdioApi>());
const UFFDIO_REGISTER: libc::c_ulong = iowr(0xAA, 0x00, std::mem::size_of::<UffdioRegister>());
/// `_IOR(0xAA, 0x01, struct uffdio_range)`: only read by the kernel.
const UFFDIO_UNREGISTER: libc::c_ulong = (2 << 30) | (16 << 16) | (0xAA << 8) | 0x01;
const PAGEMAP_SCAN: libc::c_ulong = iowr(b'f', 16, std::mem::size_of::<PmScanArg>());
/// Protect the pages the scan matched (written ones) again, as it reports them.
const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
/// Fail unless every mapping in the range is registered for asynchronous write protection.
const PM_SCAN_CHECK_WPASYNC: u64 = 1 << 1;
const PAGE_IS_WRITTEN: u64 = 1 << 1;

/// The process's watch: a userfaultfd registered for asynchronous write protection, and its
/// page map. One per process (see `crate::untouched`); a forked child's is not its own.
pub struct PageWatch {
    uffd: OwnedFd,
    pagemap: File,
    page: usize,
    pid: u32,
}

impl PageWatch {
    /// `None` where the kernel offers no asynchronous write protection (older than 6.7, or
    /// userfaultfd disabled) or this is not Linux on x86-64 or AArch64.
    pub fn open() -> Option<PageWatch> {
        if !cfg!(all(
            target_os = "linux",
            any(target_arch = "x86_64", target_arch = "aarch64")
        )) {
            return None;
        }
        // SAFETY: a plain system call; a non-negative result is a new descriptor we own.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_userfaultfd,
                libc::O_CLOEXEC | libc::O_NONBLOCK | UFFD_USER_MODE_ONLY,
            )
        };
        let fd = libc::c_int::try_from(fd).ok().filter(|fd| *fd >= 0)?;
        // SAFETY: `fd` was just returned to us and nothing else owns it.
        let uffd = unsafe { OwnedFd::from_raw_fd(fd) };
        let wanted = UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED;
        let mut api = UffdioApi {
            api: UFFD_API,
            features: wanted,
            ioctls: 0,
        };
        // SAFETY: the ioctl reads and writes `api`, a live struct of the size its number says.
        if unsafe { libc::ioctl(uffd.as_raw_fd(), UFFDIO_API, &mut api) } != 0
            || api.features & wanted != wanted
        {
            return None;
        }
        let pagemap = File::open("/proc/self/pagemap").ok()?;
        // SAFETY: sysconf only reads a constant.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok()?;
        if page == 0 || !page.is_power_of_two() {
            return None;
        }
        let watch = PageWatch {
            uffd,
            pagemap,
            page,
            pid: std::process::id(),
        };
        // The kernel may accept the API and still lack the scan: proven on a page of our own.
        watch.works().then_some(watch)
    }

    /// Whether this process opened the watch (a forked child inherits the descriptor, not the
    /// registrations: its answers would be its parent's).
    pub fn is_ours(&self) -> bool {
        self.pid == std::process::id()
    }

    /// Bytes in a page.
    pub fn page(&self) -> usize {
        self.page
    }

    /// The whole pages inside `bytes`: `[start, end)`, page-aligned, or `None` where there are
    /// none.
    pub fn pages_within(&self, bytes: &[u8]) -> Option<(usize, usize)> {
        let first = bytes.as_ptr() as usize;
        let start = first.checked_add(self.page - 1)? & !(self.page - 1);
        let end = first.checked_add(bytes.len())? & !(self.page - 1);
        (start < end).then_some((start, end))
    }

    /// Watches `[start, end)` (page-aligned private anonymous memory, see [`PrivateAnon`]) and
    /// says which parts of it were written since it was last protected (all of it, the first
    /// time), protecting those pages again as it reads them. `None` where it cannot: the
    /// memory is not private anonymous, or the kernel refused.
    pub fn take_written(
        &self,
        start: usize,
        end: usize,
        anon: &PrivateAnon,
    ) -> Option<Vec<(usize, usize)>> {
        if !self.is_ours() || !anon.covers(start, end) {
            return None;
        }
        let mut register = UffdioRegister {
            start: start as u64,
            len: (end - start) as u64,
            mode: UFFDIO_REGISTER_MODE_WP,
            ioctls: 0,
        };
        // SAFETY: the ioctl reads and writes `register`, a live struct of its size; it changes
        // how the kernel handles writes to the range, never the memory itself. Registering a
        // range this descriptor registered before is allowed.
        if unsafe { libc::ioctl(self.uffd.as_raw_fd(), UFFDIO_REGISTER, &mut register) } != 0 {
            return None;
        }
        self.scan(start, end, true)
    }

    /// Stops watching `[start, end)` (whatever memory is there now): the kernel merges its
    /// mappings with their neighbours again. Best effort: nothing to stop is no error.
    pub fn unwatch(&self, start: usize, end: usize) {
        if !self.is_ours() {
            return;
        }
        let range = [start as u64, (end - start) as u64];
        // SAFETY: the ioctl reads `range` (a `struct uffdio_range`); unregistering only lifts
        // protection (pages are left writable), never changes the memory.
        unsafe { libc::ioctl(self.uffd.as_raw_fd(), UFFDIO_UNREGISTER, range.as_ptr()) };
    }

    /// Which parts of `[start, end)` were written since last protected, leaving them as they
    /// are; `None` where it cannot tell (a part not watched: unmapped since, or never).
    pub fn written(&self, start: usize, end: usize) -> Option<Vec<(usize, usize)>> {
        if !self.is_ours() {
            return None;
        }
        self.scan(start, end, false)
    }

    /// With these masks (written pages, exactly) the kernel takes its fast path, where every page
    /// not marked protected counts as written: keep them so.
    fn scan(&self, start: usize, end: usize, protect: bool) -> Option<Vec<(usize, usize)>> {
        // A range with no mapping at all scans clean, without an error (the check of
        // registration sees no mapping to check): a range not wholly mapped is no answer.
        // SAFETY: msync of an asynchronous kind only checks the range is mapped, here.
        if unsafe { libc::msync(start as *mut libc::c_void, end - start, libc::MS_ASYNC) } != 0 {
            return None;
        }
        let mut found = Vec::new();
        let mut regions = [PageRegion::default(); 64];
        let mut from = start as u64;
        while from < end as u64 {
            let mut arg = PmScanArg {
                size: std::mem::size_of::<PmScanArg>() as u64,
                flags: PM_SCAN_CHECK_WPASYNC | if protect { PM_SCAN_WP_MATCHING } else { 0 },
                start: from,
                end: end as u64,
                walk_end: 0,
                vec: regions.as_mut_ptr() as u64,
                vec_len: regions.len() as u64,
                max_pages: 0,
                category_inverted: 0,
                category_mask: PAGE_IS_WRITTEN,
                category_anyof_mask: 0,
                return_mask: PAGE_IS_WRITTEN,
            };
            // SAFETY: the ioctl reads `arg` and writes at most `vec_len` regions into
            // `regions`, both live for the call; protecting pages never changes their bytes.
            let n = unsafe { libc::ioctl(self.pagemap.as_raw_fd(), PAGEMAP_SCAN, &mut arg) };
            let n = usize::try_from(n).ok()?;
            found.extend(
                regions[..n.min(regions.len())]
                    .iter()
                    .map(|r| (r.start as usize, r.end as usize)),
            );
            if arg.walk_end <= from {
                return None; // no progress: not an answer to trust
            }
            from = arg.walk_end;
        }
        Some(found)
    }

    /// What the watch's answers rest on, proven on memory of our own: a part of a mapping that
    /// has no page table yet reads as written (kernels without the fix of July 2026,
    /// "fix PAGEMAP_SCAN written state for PMD holes", report it clean: a whole 2 MiB that
    /// MADV_DONTNEED or reclaim gave back would then change unseen), a write is seen on its page
    /// only, and memory unmapped is not answered for.
    fn works(&self) -> bool {
        const TABLE: usize = 2 << 20; // what one page table maps (x86-64, AArch64 with 4 KiB pages)
        let len = 2 * TABLE;
        let Some(at) = map_anonymous(len) else {
            return false;
        };
        let start = (at as usize).next_multiple_of(TABLE);
        let end = start + TABLE; // (inside: the mapping is two tables long)
        let works = PrivateAnon::read().is_some_and(|anon| {
            self.take_written(start, end, &anon) == Some(vec![(start, end)])
                && self.written(start, end) == Some(vec![])
                && {
                    // SAFETY: inside the mapping made above.
                    unsafe { std::ptr::write_volatile((start + self.page) as *mut u8, 1) };
                    self.written(start, end)
                        == Some(vec![(start + self.page, start + 2 * self.page)])
                }
        });
        // SAFETY: the mapping made above, no longer used.
        unsafe { libc::munmap(at, len) };
        works && self.written(start, end).is_none()
    }
}

/// A fresh private anonymous mapping of `len` bytes, for the watch's own checks (its caller
/// unmaps it).
fn map_anonymous(len: usize) -> Option<*mut libc::c_void> {
    // SAFETY: maps fresh memory, nothing else's.
    let mapped = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    (mapped != libc::MAP_FAILED).then_some(mapped)
}

/// This process's private anonymous mappings, from `/proc/self/maps`: read one per save.
pub struct PrivateAnon {
    spans: Vec<(usize, usize)>,
    /// Mappings of every kind (each watched range is one, and the kernel caps their number).
    mappings: usize,
}

impl PrivateAnon {
    pub fn read() -> Option<PrivateAnon> {
        let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
        let mut spans: Vec<(usize, usize)> = Vec::new();
        let mappings = maps.lines().count();
        for line in maps.lines() {
            let mut fields = line.split_ascii_whitespace();
            let (Some(range), Some(perms), Some(_offset), Some(dev), Some(inode)) = (
                fields.next(),
                fields.next(),
                fields.next(),
                fields.next(),
                fields.next(),
            ) else {
                continue;
            };
            let name = fields.next().unwrap_or("");
            // Anonymous (no file, no device) and private; the heap's and unnamed mappings only
            // (not the stack, nor the kernel's special ones).
            if !(perms.starts_with("rw") && perms.ends_with('p'))
                || inode != "0"
                || dev != "00:00"
                || !(name.is_empty() || name == "[heap]")
            {
                continue;
            }
            let Some((a, b)) = range.split_once('-') else {
                continue;
            };
            let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
            else {
                continue;
            };
            match spans.last_mut() {
                Some(last) if last.1 == a => last.1 = b, // adjacent: one span
                _ => spans.push((a, b)),
            }
        }
        Some(PrivateAnon { spans, mappings })
    }

    /// Whether `[start, end)` lies wholly in private anonymous memory.
    pub fn covers(&self, start: usize, end: usize) -> bool {
        self.spans.iter().any(|&(a, b)| a <= start && end <= b)
    }

    /// Whether `more` mappings (up to three for each range watched: it splits the one it lies
    /// in) leave at least half of the kernel's cap (`vm.max_map_count`) to the program.
    pub fn room_for(&self, more: usize) -> bool {
        let cap = std::fs::read_to_string("/proc/sys/vm/max_map_count")
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok())
            .unwrap_or(65_530);
        self.mappings.saturating_add(more) <= cap / 2
    }
}

/// Whether some memory of this process is pinned for a device or the kernel to write into
/// later, behind the page tables (RDMA memory regions, io_uring's registered buffers, vfio:
/// `VmPin` in `/proc/self/status`): such writes are never seen.
pub fn pinned_memory() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let pinned = status.lines().find_map(|l| l.strip_prefix("VmPin:"));
    // (unreadable: taken as pinned)
    pinned.is_none_or(|kb| kb.trim().trim_end_matches("kB").trim() != "0")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watch() -> PageWatch {
        PageWatch::open().expect("this machine's kernel has asynchronous write protection")
    }

    fn pages(n: usize) -> Vec<u8> {
        vec![7u8; n * 4096 + 4096]
    }

    #[test]
    fn a_write_is_seen_once_and_only_on_its_page() {
        let w = watch();
        let mut memory = pages(16);
        let (start, end) = w.pages_within(&memory).unwrap();
        let anon = PrivateAnon::read().unwrap();
        assert_eq!(
            w.take_written(start, end, &anon).unwrap().concat_len(),
            end - start
        );
        assert_eq!(w.written(start, end), Some(vec![]));
        let at = start + 5 * w.page + 100 - memory.as_ptr() as usize;
        memory[at] = 8;
        let page = start + 5 * w.page;
        assert_eq!(w.written(start, end), Some(vec![(page, page + w.page)]));
        assert_eq!(
            w.take_written(start, end, &anon),
            Some(vec![(page, page + w.page)])
        );
        assert_eq!(w.written(start, end), Some(vec![]));
        memory[at] = 8; // the same value again: still a write
        assert_eq!(w.written(start, end), Some(vec![(page, page + w.page)]));
    }

    #[test]
    fn the_kernels_writes_are_seen_too() {
        let w = watch();
        let mut memory = pages(8);
        let (start, end) = w.pages_within(&memory).unwrap();
        let anon = PrivateAnon::read().unwrap();
        w.take_written(start, end, &anon).unwrap();
        let mut source = std::fs::File::open("/dev/urandom").unwrap();
        let at = start + 3 * w.page - memory.as_ptr() as usize;
        std::io::Read::read_exact(&mut source, &mut memory[at..at + 10]).unwrap();
        let page = start + 3 * w.page;
        assert_eq!(w.written(start, end), Some(vec![(page, page + w.page)]));
    }

    #[test]
    fn memory_unmapped_and_mapped_again_is_not_answered_for() {
        let w = watch();
        let len = 8 * w.page;
        let at = map_anonymous(len).unwrap();
        let (start, end) = (at as usize, at as usize + len);
        w.take_written(start, end, &PrivateAnon::read().unwrap())
            .unwrap();
        // SAFETY: replaces our own mapping by a fresh one at the same address.
        let again = unsafe {
            libc::mmap(
                at,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        assert_eq!(again, at);
        assert_eq!(w.written(start, end), None);
        // SAFETY: ours, unused from here on.
        unsafe { libc::munmap(at, len) };
    }

    #[test]
    fn memory_unwatched_is_not_answered_for() {
        let w = watch();
        let memory = pages(8);
        let (start, end) = w.pages_within(&memory).unwrap();
        w.take_written(start, end, &PrivateAnon::read().unwrap())
            .unwrap();
        assert_eq!(w.written(start, end), Some(vec![]));
        w.unwatch(start, end);
        assert_eq!(w.written(start, end), None);
    }

    #[test]
    fn a_file_mapping_is_never_watched() {
        let w = watch();
        let mut file = tempfile::tempfile().unwrap();
        std::io::Write::write_all(&mut file, &vec![1u8; 8 * w.page]).unwrap();
        let map = unsafe { memmap2::MmapOptions::new().map_copy(&file) }.unwrap();
        let (start, end) = w.pages_within(&map).unwrap();
        assert_eq!(
            w.take_written(start, end, &PrivateAnon::read().unwrap()),
            None
        );
        assert_eq!(w.written(start, end), None);
    }

    trait ConcatLen {
        fn concat_len(&self) -> usize;
    }

    impl ConcatLen for Vec<(usize, usize)> {
        fn concat_len(&self) -> usize {
            self.iter().map(|(a, b)| b - a).sum()
        }
    }
}
