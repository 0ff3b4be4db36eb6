//! Bytes -> checkpoint: verify, then index every tensor as a byte range.
//!
//! Nothing here copies tensor values; the result holds offsets into the
//! caller's buffer (the mapped file), so decoding costs O(metadata).

use flatbuffers::{ForwardsUOffset, Vector, VerifierOptions};

use super::dtype::{element_count, DataType};
use super::model::{
    Checkpoint, OptimizerGroup, ParameterOptimizerState, PropertyBag, Stored, Tensor,
};
use super::names::first_clash;
use super::verify::verify_checkpoint;
use super::{Role, CHECKPOINT_VERSION, FILE_IDENTIFIER, FIRST_CHECKPOINT_VERSION};
use crate::error::{Error, ErrorKind, Result};
use crate::generated::onnxruntime::fbs;

/// Smallest buffer that can hold a root offset and a file identifier.
const MIN_LEN: usize = 8;

/// Verifies `buf` as an ODTC checkpoint (version 2, or the version 1 of ONNX Runtime
/// 1.16, which differs only in lacking the module state's two flags) and indexes its
/// contents.
///
/// # Errors
/// [`ErrorKind::Malformed`] for anything the flatbuffers verifier rejects and for
/// what it cannot see (version, required fields, dims versus byte length,
/// duplicate names); [`ErrorKind::UnsupportedDataType`] for unknown type codes.
pub fn decode(buf: &[u8]) -> Result<Checkpoint<Stored>> {
    if buf.len() < MIN_LEN {
        return Err(Error::malformed(format!(
            "file is too short to be a checkpoint ({} bytes)",
            buf.len()
        )));
    }
    if !fbs::checkpoint_buffer_has_identifier(buf) {
        return Err(Error::malformed(format!(
            "not an ONNX Runtime training checkpoint: file identifier is {:?}, expected {:?}",
            String::from_utf8_lossy(&buf[4..8]),
            FILE_IDENTIFIER
        )));
    }
    verify_checkpoint(&verifier_options(buf.len()), buf).map_err(|e| {
        // The verifier's message carries a multi-line trace; its first line says what failed.
        let first = e.to_string().lines().next().unwrap_or_default().to_owned();
        Error::malformed(format!("checkpoint verification failed: {first}"))
    })?;
    // SAFETY: verify_checkpoint checked every table, vector and string reachable from
    // the root, as the generated verifier would (int64 vectors only 4-byte aligned,
    // which is sound because flatbuffers reads scalars with unaligned copies).
    let root = unsafe { fbs::root_as_checkpoint_unchecked(buf) };
    let version = root.version();
    if !(FIRST_CHECKPOINT_VERSION..=CHECKPOINT_VERSION).contains(&version) {
        return Err(Error::malformed(format!(
            "checkpoint version {version} is not supported (ONNX Runtime has written versions \
             {FIRST_CHECKPOINT_VERSION} and {CHECKPOINT_VERSION})"
        )));
    }

    let decoder = Decoder {
        base: buf.as_ptr() as usize,
    };
    let mut ckpt = Checkpoint {
        version,
        ..Checkpoint::default()
    };
    if let Some(module) = root.module_state() {
        ckpt.is_nominal = module.is_nominal_state();
        ckpt.has_external_data = module.has_external_data();
        // Version 2 (ONNX Runtime 1.17) added both flags; a version-1 writer cannot set them.
        if version == 1 && (ckpt.is_nominal || ckpt.has_external_data) {
            return Err(Error::malformed(
                "a version-1 checkpoint cannot be nominal or have external data (version 2 added both)",
            ));
        }
        let trainable = module
            .requires_grad_params()
            .ok_or_else(|| Error::malformed("module state has no requires_grad_params vector"))?;
        let frozen = module
            .frozen_params()
            .ok_or_else(|| Error::malformed("module state has no frozen_params vector"))?;
        ckpt.trainable = decoder.tensors(trainable, Role::Trainable, &ckpt)?;
        ckpt.frozen = decoder.tensors(frozen, Role::Frozen, &ckpt)?;
    }
    if let Some(groups) = root.optimizer_groups() {
        for group in groups {
            let decoded = decoder.group(group, &ckpt)?;
            ckpt.optimizer_groups.push(decoded);
        }
    }
    if let Some(bag) = root.property_bag() {
        ckpt.properties = properties(bag)?;
    }
    if let Some(clash) = first_clash(&ckpt) {
        return Err(clash.into_error(Error::malformed));
    }
    reject_shared_values(&ckpt)?;
    Ok(ckpt)
}

/// Two tensors whose values overlap would be two views of the same bytes: writing
/// one parameter would silently change another. ONNX Runtime never writes such a
/// file (it copies every tensor on load), so one is malformed or hostile.
fn reject_shared_values(ckpt: &Checkpoint<Stored>) -> Result<()> {
    // (in the data file?, start, end, name)
    let mut ranges: Vec<(bool, u64, u64, String)> = ckpt
        .tensors_named()
        .filter_map(|(name, t)| match t.data {
            Stored::Inline { offset, len } if len > 0 => {
                Some((false, offset as u64, (offset + len) as u64, name))
            }
            Stored::External { offset, len } if len > 0 => {
                Some((true, offset, offset.saturating_add(len), name))
            }
            _ => None,
        })
        .collect();
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        if a.0 == b.0 && b.1 < a.2 {
            return Err(Error::malformed(format!(
                "the values of {} and {} overlap ({} bytes {}..{} and {}..{})",
                a.3,
                b.3,
                if a.0 { "external data" } else { "file" },
                a.1,
                a.2,
                b.1,
                b.2
            ))
            .in_tensor(&b.3));
        }
    }
    Ok(())
}

/// Limits that keep a hostile file from costing more than its own size.
fn verifier_options(len: usize) -> VerifierOptions {
    VerifierOptions {
        max_depth: 64,
        // Every table takes at least 4 bytes (its vtable offset).
        max_tables: len / 4 + 1,
        // Each byte may be referenced at most twice over before we call it a DAG bomb.
        max_apparent_size: len.saturating_mul(2),
        ignore_missing_null_terminator: false,
    }
}

struct Decoder {
    /// Address of the buffer's first byte, to turn slices into file offsets.
    base: usize,
}

impl Decoder {
    fn tensors(
        &self,
        list: Vector<'_, ForwardsUOffset<fbs::Tensor<'_>>>,
        role: Role,
        ckpt: &Checkpoint<Stored>,
    ) -> Result<Vec<Tensor<Stored>>> {
        list.iter()
            .enumerate()
            .map(|(i, t)| self.tensor(t, i, role, ckpt))
            .collect()
    }

    fn tensor(
        &self,
        t: fbs::Tensor<'_>,
        index: usize,
        role: Role,
        ckpt: &Checkpoint<Stored>,
    ) -> Result<Tensor<Stored>> {
        let name = t.name().ok_or_else(|| {
            Error::malformed(format!("{} tensor #{index} has no name", role.label()))
        })?;
        let in_tensor = |e: Error| e.in_tensor(name);
        let dims: Vec<i64> = t
            .dims()
            .ok_or_else(|| Error::malformed("tensor has no dims"))
            .map_err(in_tensor)?
            .iter()
            .collect();
        let data_type = DataType::from_code(t.data_type().0).map_err(in_tensor)?;
        if data_type == DataType::Undefined {
            return Err(Error::new(ErrorKind::UnsupportedDataType(0)).in_tensor(name));
        }
        let data = if ckpt.is_nominal {
            Stored::Absent
        } else {
            self.values(&t, data_type, &dims, ckpt.has_external_data)
                .map_err(in_tensor)?
        };
        Ok(Tensor {
            name: name.to_owned(),
            data_type,
            dims,
            data,
        })
    }

    fn values(
        &self,
        t: &fbs::Tensor<'_>,
        data_type: DataType,
        dims: &[i64],
        has_external_data: bool,
    ) -> Result<Stored> {
        let count = element_count(dims, data_type).map_err(Error::malformed)?;
        if data_type == DataType::String {
            let strings = t
                .string_data()
                .ok_or_else(|| Error::malformed("STRING tensor has no string_data"))?;
            if strings.len() as u64 != count {
                return Err(Error::malformed(format!(
                    "string_data holds {} strings but dims {dims:?} need {count}",
                    strings.len()
                )));
            }
            return Ok(Stored::Strings(strings.iter().map(str::to_owned).collect()));
        }
        let expected = data_type.byte_len(count).ok_or_else(|| {
            Error::malformed(format!(
                "dims {dims:?} of {} overflow the byte length",
                data_type.name()
            ))
        })?;
        let offset = t.external_data_offset();
        if offset >= 0 {
            if !has_external_data {
                return Err(Error::malformed(
                    "tensor has an external_data_offset but the checkpoint has no external data",
                ));
            }
            return Ok(Stored::External {
                offset: offset as u64,
                len: expected,
            });
        }
        let raw = t
            .raw_data()
            .ok_or_else(|| Error::malformed("tensor has neither raw_data nor external data"))?
            .bytes();
        if raw.len() as u64 != expected {
            return Err(Error::malformed(format!(
                "raw_data holds {} bytes but dims {dims:?} of {} need {expected}",
                raw.len(),
                data_type.name()
            )));
        }
        Ok(Stored::Inline {
            offset: raw.as_ptr() as usize - self.base,
            len: raw.len(),
        })
    }

    fn group(
        &self,
        g: fbs::OptimizerGroup<'_>,
        ckpt: &Checkpoint<Stored>,
    ) -> Result<OptimizerGroup<Stored>> {
        let name = g
            .group_name()
            .ok_or_else(|| Error::malformed("optimizer group has no name"))?;
        let mut states = Vec::new();
        for (i, s) in g.optimizer_states().into_iter().flatten().enumerate() {
            let param_name = s.param_name().ok_or_else(|| {
                Error::malformed(format!(
                    "optimizer group '{name}': state #{i} has no param_name"
                ))
            })?;
            let momentums = match s.momentums() {
                Some(list) => self
                    .tensors(list, Role::Momentum, ckpt)
                    .map_err(|e| e.in_tensor_scope(&format!("{name}/{param_name}")))?,
                None => Vec::new(),
            };
            states.push(ParameterOptimizerState {
                param_name: param_name.to_owned(),
                momentums,
            });
        }
        Ok(OptimizerGroup {
            name: name.to_owned(),
            step: g.step(),
            initial_learning_rate: g.initial_learning_rate(),
            states,
        })
    }
}

fn properties(bag: fbs::PropertyBag<'_>) -> Result<PropertyBag> {
    let missing = |kind: &str, i: usize, what: &str| {
        Error::malformed(format!("{kind} property #{i} has no {what}"))
    };
    let mut out = PropertyBag::default();
    for (i, p) in bag.ints().into_iter().flatten().enumerate() {
        let name = p.name().ok_or_else(|| missing("int", i, "name"))?;
        out.ints.push((name.to_owned(), p.value()));
    }
    for (i, p) in bag.floats().into_iter().flatten().enumerate() {
        let name = p.name().ok_or_else(|| missing("float", i, "name"))?;
        out.floats.push((name.to_owned(), p.value()));
    }
    for (i, p) in bag.strings().into_iter().flatten().enumerate() {
        let name = p.name().ok_or_else(|| missing("string", i, "name"))?;
        let value = p.value().ok_or_else(|| missing("string", i, "value"))?;
        out.strings.push((name.to_owned(), value.to_owned()));
    }
    Ok(out)
}
