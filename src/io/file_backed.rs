//! Which bytes of this process's memory cannot differ from a file's: a slice of a file mapping
//! none of whose pages has been written in this process. Such a slice *is* the file's bytes at
//! its offset (read through the page cache), so a save that shares that file at that offset
//! need not compare them: they cannot have changed.
//!
//! The proof, from the kernel's own records (Linux `/proc/self/maps` and `/proc/self/pagemap`,
//! no privileges needed): the slice lies in one mapping of the file, and each of its pages is
//! either still the file's page (present, "file-page" set) or not in memory at all (not present
//! and not swapped out: touching it reads the file). A page written in a private mapping is
//! copied first (copy-on-write) and then reads as an anonymous page, or as swapped out: never
//! proven. Anything this cannot read or parse proves nothing.

use std::fs::File;
use std::os::unix::fs::FileExt;

use super::FileId;

/// Bits of a `/proc/self/pagemap` entry (see the kernel's admin-guide/mm/pagemap).
const PRESENT: u64 = 1 << 63;
const SWAPPED: u64 = 1 << 62;
const FILE_PAGE: u64 = 1 << 61;

/// One file mapping of this process, from `/proc/self/maps`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Mapping {
    start: usize,
    end: usize,
    /// Where `start` lies in the file.
    offset: u64,
    major: u32,
    minor: u32,
    inode: u64,
}

/// A snapshot of this process's file mappings and a handle on its page map: take one per save,
/// then ask [`FileBacked::span`] for each slice.
pub struct FileBacked {
    mappings: Vec<Mapping>,
    pagemap: File,
    page: usize,
}

impl FileBacked {
    /// The process's mappings now; `None` where `/proc` cannot tell (not Linux, no procfs).
    pub fn read() -> Option<FileBacked> {
        let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
        let pagemap = File::open("/proc/self/pagemap").ok()?;
        // SAFETY: sysconf only reads a constant.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok()?;
        if page == 0 || !page.is_power_of_two() {
            return None;
        }
        let mappings = maps.lines().filter_map(parse_line).collect();
        Some(FileBacked {
            mappings,
            pagemap,
            page,
        })
    }

    /// Where `bytes` are the current bytes of a file, proven: that file and the offset of
    /// `bytes`' first byte in it. `None` when not proven (anonymous memory, any page written
    /// since it was mapped, swapped, split across mappings, or `/proc` unreadable).
    pub fn span(&self, bytes: &[u8]) -> Option<(FileId, u64)> {
        if bytes.is_empty() {
            return None;
        }
        let start = bytes.as_ptr() as usize;
        let end = start.checked_add(bytes.len())?;
        let m = self
            .mappings
            .iter()
            .find(|m| m.start <= start && end <= m.end)?;
        if !self.pages_are_the_files(start, end) {
            return None;
        }
        let offset = m.offset.checked_add((start - m.start) as u64)?;
        Some((FileId::from_parts(m.major, m.minor, m.inode), offset))
    }

    /// Whether every page of `start..end` is the file's own page or not in memory at all.
    fn pages_are_the_files(&self, start: usize, end: usize) -> bool {
        let (first, last) = (start / self.page, (end - 1) / self.page);
        // In pieces of 64k entries (512 KiB read, 256 MiB of memory with 4 KiB pages).
        const CHUNK: usize = 1 << 16;
        let mut buffer = vec![0u8; 8 * CHUNK.min(last - first + 1)];
        let mut page = first;
        while page <= last {
            let count = CHUNK.min(last - page + 1);
            let want = &mut buffer[..8 * count];
            if self.pagemap.read_exact_at(want, (page as u64) * 8).is_err() {
                return false;
            }
            let all_files = want.chunks_exact(8).all(|entry| {
                let entry = u64::from_le_bytes(entry.try_into().unwrap());
                if entry & PRESENT != 0 {
                    entry & FILE_PAGE != 0
                } else {
                    entry & SWAPPED == 0
                }
            });
            if !all_files {
                return false;
            }
            page += count;
        }
        true
    }
}

/// A line of `/proc/self/maps` that maps a file (`start-end perms offset major:minor inode
/// path`); `None` for anonymous memory (inode 0), a shared writable mapping and anything
/// unparsable.
fn parse_line(line: &str) -> Option<Mapping> {
    let mut fields = line.split_ascii_whitespace();
    let (range, perms, offset, device, inode) = (
        fields.next()?,
        fields.next()?,
        fields.next()?,
        fields.next()?,
        fields.next()?,
    );
    let (start, end) = range.split_once('-')?;
    let (major, minor) = device.split_once(':')?;
    let inode: u64 = inode.parse().ok()?;
    // A shared writable mapping writes into the file's own pages, so its pages stay "file
    // pages" after a write: only private (copy-on-write) or read-only mappings prove anything.
    let perms = perms.as_bytes();
    let shared_writable = perms.get(1) != Some(&b'-') && perms.get(3) != Some(&b'p');
    if inode == 0 || perms.len() < 4 || shared_writable {
        return None;
    }
    Some(Mapping {
        start: usize::from_str_radix(start, 16).ok()?,
        end: usize::from_str_radix(end, 16).ok()?,
        offset: u64::from_str_radix(offset, 16).ok()?,
        major: u32::from_str_radix(major, 16).ok()?,
        minor: u32::from_str_radix(minor, 16).ok()?,
        inode,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use memmap2::MmapOptions;
    use std::io::Write;

    fn file_of(bytes: &[u8]) -> (tempfile::NamedTempFile, FileId) {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(bytes).unwrap();
        f.flush().unwrap();
        let id = FileId::of_path(f.path()).unwrap();
        (f, id)
    }

    #[test]
    fn a_mapped_slice_never_written_is_the_files_at_its_offset() {
        let (f, id) = file_of(&vec![3u8; 5 * 4096]);
        let map = unsafe { MmapOptions::new().map_copy(f.as_file()) }.unwrap();
        let _ = map[4096 * 2]; // one page read in, the others not in memory yet
        let backed = FileBacked::read().unwrap();
        assert_eq!(backed.span(&map[4096 + 10..4096 * 3]), Some((id, 4106)));
        assert_eq!(backed.span(&map[..]), Some((id, 0)));
    }

    #[test]
    fn a_written_page_or_anonymous_memory_proves_nothing() {
        let (f, id) = file_of(&vec![3u8; 4 * 4096]);
        let mut map = unsafe { MmapOptions::new().map_copy(f.as_file()) }.unwrap();
        map[4096 * 3 + 7] = 3; // the same value: written all the same (a private copy now)
        let backed = FileBacked::read().unwrap();
        assert_eq!(backed.span(&map[..4096 * 3]), Some((id, 0)));
        assert_eq!(backed.span(&map[4096 * 2..]), None);
        let heap = vec![3u8; 4 * 4096];
        assert_eq!(backed.span(&heap), None);
        assert_eq!(backed.span(&[]), None);
    }

    #[test]
    fn a_shared_writable_mapping_proves_nothing() {
        // Its written pages stay the file's own pages: the page map cannot tell them apart.
        let (f, _) = file_of(&vec![3u8; 2 * 4096]);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(f.path())
            .unwrap();
        let mut map = unsafe { MmapOptions::new().map_mut(&file) }.unwrap();
        map[7] = 9;
        let backed = FileBacked::read().unwrap();
        assert_eq!(backed.span(&map[..]), None);
        assert_eq!(
            parse_line("7f1c2a000000-7f1c2a400000 rw-s 00000000 fd:01 1234567    /tmp/x.data"),
            None
        );
        assert!(
            parse_line("7f1c2a000000-7f1c2a400000 r--s 00000000 fd:01 1234567    /tmp/x").is_some()
        );
    }

    #[test]
    fn a_mapping_made_after_the_snapshot_is_not_in_it() {
        let backed = FileBacked::read().unwrap();
        let (f, _) = file_of(&vec![1u8; 4096]);
        let map = unsafe { MmapOptions::new().map_copy(f.as_file()) }.unwrap();
        assert_eq!(backed.span(&map[..]), None);
    }

    #[test]
    fn lines_of_maps_parse_and_anonymous_ones_are_skipped() {
        let line = "7f1c2a000000-7f1c2a400000 r--p 00001000 fd:01 1234567    /tmp/x.data";
        let m = parse_line(line).unwrap();
        assert_eq!(
            (m.start, m.end, m.offset, m.major, m.minor, m.inode),
            (0x7f1c2a000000, 0x7f1c2a400000, 0x1000, 0xfd, 1, 1234567)
        );
        assert_eq!(
            parse_line("7ffd1000-7ffd2000 rw-p 00000000 00:00 0    [stack]"),
            None
        );
        assert_eq!(parse_line("garbage"), None);
    }
}
