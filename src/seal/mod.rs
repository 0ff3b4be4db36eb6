//! What seals a checkpoint's files together, below both the format and the files: the pair
//! trailer that ties a checkpoint to its external data file, the checksum block, and the data
//! file's name. [`crate::format`] lays them out in the bytes; [`crate::io`] reads them to commit
//! and clean up; neither reaches into the other for them.

pub mod checksums;
pub mod pairing;

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The external data file of a checkpoint: `<path>.data`, as ONNX Runtime names it.
pub fn external_data_path(path: &Path) -> PathBuf {
    let mut name = OsString::from(path.as_os_str());
    name.push(".data");
    PathBuf::from(name)
}
