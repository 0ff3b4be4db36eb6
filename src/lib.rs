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
//! Checkpoints whose values exceed a threshold (1800 MiB by default, as in ONNX
//! Runtime) keep them in an external data file, `<checkpoint>.data`.
//!
//! Layout, in layers, each module using only the layers below its own
//! (tests/python/design/test_design_rules_rust.py holds it, and no circle between files):
//! 1. [`error`] and `random`;
//! 2. [`seal`]: the pair trailer, the checksum block, the data file's name;
//! 3. `generated`: flatc's output;
//! 4. [`format`](mod@format) (bytes <-> [`format::Checkpoint`], no filesystem) and [`io`] (maps,
//!    temporary files, locks, the one commit: byte ranges, not tensors), neither using the other;
//! 5. [`compute`] (kernels), `load` and `save` (a checkpoint's files: format and io joined),
//!    `untouched` (values in memory proven the bytes a checkpoint keeps);
//! 6. `integrity` (checksums checked, staged files resealed) and [`sharing`];
//! 7. `python`: the PyO3 boundary (the `python` feature).
//!
//! This file is the face: module declarations and re-exports only.

pub mod compute;
pub mod error;
pub mod format;
#[allow(clippy::all, unused_imports, dead_code, non_camel_case_types, unsafe_op_in_unsafe_fn)]
#[rustfmt::skip]
pub mod generated;
mod integrity;
pub mod io;
mod load;
#[cfg(feature = "python")]
mod python;
mod random;
mod save;
pub mod seal;
pub mod sharing;
mod untouched;

pub use error::{Error, ErrorKind, Result};
pub use integrity::{checksum_root_of_file, reseal, seal_written, Checked, Filled};
pub use load::{decode_buffer, decode_buffer_paired, load, load_with, LoadedCheckpoint};
pub use save::{
    encode_for_stream, encode_in_memory, save, write_staged, PlacedValues, SaveOptions,
    DEFAULT_EXTERNAL_DATA_THRESHOLD,
};
pub use seal::external_data_path;
