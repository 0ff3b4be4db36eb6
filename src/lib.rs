//! Fast, zero-copy reading and writing of ONNX Runtime training checkpoints
//! (the flatbuffers "ODTC" format, version 2).
//!
//! ```no_run
//! use ortckpt::{load, save, format::{Checkpoint, DataType, Payload, Tensor}, SaveOptions};
//!
//! let weights: Vec<f32> = vec![0.5; 6];
//! let bytes: Vec<u8> = weights.iter().flat_map(|v| v.to_le_bytes()).collect();
//! let mut ckpt = Checkpoint::default();
//! ckpt.trainable.push(Tensor {
//!     name: "fc.weight".into(),
//!     data_type: DataType::Float,
//!     dims: vec![2, 3],
//!     data: Payload::Bytes(&bytes),
//! });
//! save("model.ckpt".as_ref(), &mut ckpt, &SaveOptions::default())?;
//!
//! let loaded = load("model.ckpt".as_ref())?;
//! let weight = &loaded.checkpoint().trainable[0];
//! assert_eq!(loaded.bytes(weight)?, &bytes[..]);
//! # Ok::<(), ortckpt::Error>(())
//! ```
//!
//! Layout: [`format`] turns bytes into a [`format::Checkpoint`] and back without
//! touching the filesystem; [`io`] maps and atomically writes files; the
//! `python` feature adds the PyO3 extension module.

pub mod error;
pub mod format;
#[allow(clippy::all, unused_imports, dead_code, non_camel_case_types, unsafe_op_in_unsafe_fn)]
#[rustfmt::skip]
pub mod generated;
pub mod io;
#[cfg(feature = "python")]
mod python;

use std::path::{Path, PathBuf};

use memmap2::MmapMut;

pub use error::{Error, ErrorKind, Result};
use format::{Checkpoint, Payload, Stored, Tensor};

/// Options for [`save`].
#[derive(Clone, Debug, Default)]
pub struct SaveOptions {
    /// fsync the file and its directory before returning (survives power loss, costs time).
    pub durable: bool,
}

/// A checkpoint opened by [`load`]: the decoded metadata and the private mapping
/// its tensor bytes live in.
pub struct LoadedCheckpoint {
    path: PathBuf,
    map: MmapMut,
    checkpoint: Checkpoint<Stored>,
}

impl std::fmt::Debug for LoadedCheckpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedCheckpoint")
            .field("path", &self.path)
            .field("len", &self.map.len())
            .field("checkpoint", &self.checkpoint)
            .finish()
    }
}

impl LoadedCheckpoint {
    pub fn checkpoint(&self) -> &Checkpoint<Stored> {
        &self.checkpoint
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The bytes of `tensor` (which must come from this checkpoint), without copying.
    ///
    /// # Errors
    /// STRING tensors and nominal tensors have no bytes.
    pub fn bytes(&self, tensor: &Tensor<Stored>) -> Result<&[u8]> {
        match tensor.data {
            Stored::Inline { offset, len } => self
                .map
                .get(offset..offset + len)
                .ok_or_else(|| Error::malformed("tensor bytes lie outside the file")),
            Stored::External { .. } | Stored::Strings(_) | Stored::Absent => Err(Error::invalid_state(
                "tensor has no inline bytes (strings or nominal values)",
            )),
        }
        .map_err(|e| e.in_tensor(&tensor.name).in_file(&self.path))
    }

    /// The checkpoint with every tensor's values borrowed from the mapping,
    /// ready to be saved elsewhere.
    pub fn as_payloads(&self) -> Result<Checkpoint<Payload<'_>>> {
        self.checkpoint.try_map_data(|t| match &t.data {
            Stored::Strings(s) => Ok(Payload::Strings(s.clone())),
            Stored::Absent => Ok(Payload::Absent),
            _ => self.bytes(t).map(Payload::Bytes),
        })
    }

    /// The mapping and the metadata, for callers (the Python layer) that hand out views.
    pub fn into_parts(self) -> (MmapMut, Checkpoint<Stored>) {
        (self.map, self.checkpoint)
    }
}

/// Maps and verifies the checkpoint at `path`; tensor bytes are not read until used.
///
/// # Errors
/// OS errors (missing file...), malformed files and unsupported data types, each
/// naming the file and, where there is one, the tensor.
pub fn load(path: &Path) -> Result<LoadedCheckpoint> {
    format::endian::ensure_host_little_endian()?;
    let map = io::map_private(path, 8, |len| {
        Error::malformed(format!("file is too short to be a checkpoint ({len} bytes)"))
    })?;
    let checkpoint = format::decode(&map).map_err(|e| e.in_file(path))?;
    if checkpoint.has_external_data {
        return Err(Error::invalid_state(
            "checkpoints with external data (<checkpoint>.data) are not supported by this version",
        )
        .in_file(path));
    }
    Ok(LoadedCheckpoint { path: path.to_path_buf(), map, checkpoint })
}

/// Writes `ckpt` to `path` the way ONNX Runtime's state-path saver does (sorted
/// by name; `ckpt` is sorted in place), replacing any previous file atomically.
///
/// # Errors
/// Invalid states (bytes that disagree with dims, duplicate names) and OS errors,
/// naming the file and tensor; the previous file at `path` is left intact.
pub fn save(path: &Path, ckpt: &mut Checkpoint<Payload<'_>>, options: &SaveOptions) -> Result<()> {
    format::endian::ensure_host_little_endian()?;
    ckpt.sort_like_ort_state_path();
    let encoded = format::encode(ckpt).map_err(|e| e.in_file(path))?;
    io::replace_atomically(path, options.durable, |file| io::write_segments(file, &encoded.segments()))
}
