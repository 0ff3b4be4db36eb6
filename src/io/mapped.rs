//! Read side: a private (copy-on-write) memory map of a whole regular file.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use memmap2::{MmapMut, MmapOptions};

use crate::error::{Error, ErrorKind, Result};

/// Which file a mapping came from (device and inode): a reader compares it with what
/// the path names later, to tell whether a save replaced the file meanwhile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileId {
    dev: u64,
    ino: u64,
}

impl FileId {
    fn of(meta: &fs::Metadata) -> FileId {
        FileId {
            dev: meta.dev(),
            ino: meta.ino(),
        }
    }

    /// The file `path` names now (following symlinks, as opening does), if any.
    pub fn of_path(path: &Path) -> Option<FileId> {
        fs::metadata(path).ok().map(|m| FileId::of(&m))
    }

    /// The entry `path` names now, not following a symlink there, if any.
    pub fn of_name(path: &Path) -> Option<FileId> {
        fs::symlink_metadata(path).ok().map(|m| FileId::of(&m))
    }

    /// The file of device `major:minor` and inode `inode` (as `/proc/self/maps` names it).
    pub fn from_parts(major: u32, minor: u32, inode: u64) -> FileId {
        FileId {
            dev: libc::makedev(major, minor),
            ino: inode,
        }
    }

    /// (device, inode), as `stat` gives them (`st_dev`, `st_ino`).
    pub fn dev_and_inode(&self) -> (u64, u64) {
        (self.dev, self.ino)
    }

    /// The file an open file descriptor refers to.
    pub fn of_file(file: &File) -> Option<FileId> {
        file.metadata().ok().map(|m| FileId::of(&m))
    }
}

/// Refuses anything but a regular file, before it is read: a directory is EISDIR, a FIFO,
/// socket or device [`ErrorKind::NotRegularFile`], each naming `path`.
pub(crate) fn ensure_regular(meta: &fs::Metadata, path: &Path) -> Result<()> {
    let kind = meta.file_type();
    if kind.is_file() {
        return Ok(());
    }
    if kind.is_dir() {
        return Err(Error::from(io::Error::from_raw_os_error(libc::EISDIR)).in_file(path));
    }
    let what = if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else {
        "not a file"
    };
    Err(Error::new(ErrorKind::NotRegularFile(what)).in_file(path))
}

/// Maps `path` privately: reads come from the page cache without copying, and
/// writes go to private pages of this process, never to the file.
///
/// `min_len` is the smallest size worth mapping; a shorter file is reported by
/// `too_short` (an empty file cannot be mapped at all). Without `follow_symlinks`, a
/// symlink at `path` is refused (ELOOP): for files named by documents, which must
/// stay inside their directory.
///
/// # Errors
/// OS errors (missing file, permissions; a directory is EISDIR), anything but a regular
/// file (refused before any read, so a FIFO never blocks), and the `too_short` error,
/// with the path attached.
///
/// The open file comes back too: a check that reads every byte reads through it
/// ([`crate::integrity`]), since another process truncating the file would fault a read
/// of the mapping (SIGBUS, the end of the process) where a read(2) just comes up short.
pub fn map_private(
    path: &Path,
    follow_symlinks: bool,
    min_len: u64,
    too_short: impl FnOnce(u64) -> Error,
) -> Result<(MmapMut, FileId, File)> {
    let (file, len, id) = open(path, follow_symlinks)?;
    if len < min_len.max(1) {
        return Err(too_short(len).in_file(path));
    }
    Ok((map(&file, path)?, id, file))
}

/// Maps `path` privately whatever its size: `None` for an empty file, which
/// cannot be mapped and holds nothing.
///
/// # Errors
/// As [`map_private`].
pub fn map_private_any(
    path: &Path,
    follow_symlinks: bool,
) -> Result<(Option<MmapMut>, FileId, File)> {
    let (file, len, id) = open(path, follow_symlinks)?;
    if len == 0 {
        return Ok((None, id, file));
    }
    Ok((Some(map(&file, path)?), id, file))
}

/// Opens a regular file for reading. O_NONBLOCK: opening a FIFO would otherwise wait
/// for a writer forever; it has no effect on regular files, which are all we keep.
pub fn open(path: &Path, follow_symlinks: bool) -> Result<(File, u64, FileId)> {
    let in_file = |e: io::Error| Error::from(e).in_file(path);
    let no_follow = if follow_symlinks { 0 } else { libc::O_NOFOLLOW };
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | no_follow)
        .open(path)
        .map_err(in_file)?;
    let meta = file.metadata().map_err(in_file)?;
    ensure_regular(&meta, path)?;
    Ok((file, meta.len(), FileId::of(&meta)))
}

fn map(file: &File, path: &Path) -> Result<MmapMut> {
    // SAFETY: the mapping is private, so our writes never reach the file. Another
    // process truncating the file in place could still fault reads (SIGBUS); ortckpt
    // itself never modifies a checkpoint in place (saves replace it by rename).
    let map = unsafe { MmapOptions::new().map_copy(file) };
    map.map_err(|e| Error::from(e).in_file(path))
}
