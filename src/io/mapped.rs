//! Read side: a private (copy-on-write) memory map of a whole file.

use std::fs::File;
use std::path::Path;

use memmap2::{MmapMut, MmapOptions};

use crate::error::{Error, Result};

/// Maps `path` privately: reads come from the page cache without copying, and
/// writes go to private pages of this process, never to the file.
///
/// `min_len` is the smallest size worth mapping; a shorter file is reported by
/// `too_short` (an empty file cannot be mapped at all).
///
/// # Errors
/// OS errors (missing file, permissions) and the `too_short` error, with the path attached.
pub fn map_private(
    path: &Path,
    min_len: u64,
    too_short: impl FnOnce(u64) -> Error,
) -> Result<MmapMut> {
    let (file, len) = open(path)?;
    if len < min_len.max(1) {
        return Err(too_short(len).in_file(path));
    }
    map(&file, path)
}

/// Maps `path` privately whatever its size: `None` for an empty file, which
/// cannot be mapped and holds nothing.
///
/// # Errors
/// OS errors, with the path attached.
pub fn map_private_any(path: &Path) -> Result<Option<MmapMut>> {
    let (file, len) = open(path)?;
    if len == 0 {
        return Ok(None);
    }
    map(&file, path).map(Some)
}

fn open(path: &Path) -> Result<(File, u64)> {
    let file = File::open(path).map_err(|e| Error::from(e).in_file(path))?;
    let len = file
        .metadata()
        .map_err(|e| Error::from(e).in_file(path))?
        .len();
    Ok((file, len))
}

fn map(file: &File, path: &Path) -> Result<MmapMut> {
    // SAFETY: the mapping is private, so our writes never reach the file. Another
    // process truncating the file in place could still fault reads (SIGBUS); ortckpt
    // itself never modifies a checkpoint in place (saves replace it by rename).
    let map = unsafe { MmapOptions::new().map_copy(file) };
    map.map_err(|e| Error::from(e).in_file(path))
}
