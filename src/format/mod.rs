//! The ODTC format: bytes <-> [`Checkpoint`]. No filesystem, no Python.

pub mod decode;
pub mod dtype;
pub mod encode;
pub mod endian;
pub mod model;
pub mod names;
pub mod plan;
mod reader;
mod verify;

pub use decode::decode;
pub use dtype::DataType;
pub use encode::{encode, Encoded, Placement};
pub use model::{
    Checkpoint, OptimizerGroup, ParameterOptimizerState, Payload, PropertyBag, Stored, Tensor,
};

/// The checkpoint version ONNX Runtime >= 1.17 reads and writes, and the only one saved here.
pub const CHECKPOINT_VERSION: i32 = 2;

/// The version ONNX Runtime 1.16 wrote. Version 2 added `ModuleState.is_nominal_state`
/// (and, without a version change, `has_external_data`): version-1 files read as
/// version 2 with both false. ONNX Runtime >= 1.17 refuses them; ortckpt reads them.
pub const FIRST_CHECKPOINT_VERSION: i32 = 1;

/// The flatbuffer file identifier of training checkpoints ("ORT On-Device-Training Checkpoint").
pub const FILE_IDENTIFIER: &str = "ODTC";

/// Where a tensor sits in a checkpoint; used to word errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Trainable,
    Frozen,
    Momentum,
}

impl Role {
    pub fn label(self) -> &'static str {
        match self {
            Role::Trainable => "trainable",
            Role::Frozen => "frozen",
            Role::Momentum => "momentum",
        }
    }
}
