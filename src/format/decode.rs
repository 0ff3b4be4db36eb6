//! Bytes -> checkpoint: one checked pass that indexes every tensor as a byte range.
//!
//! Nothing here copies tensor values; the result holds offsets into the
//! caller's buffer (the mapped file), so decoding costs O(metadata). The bytes may
//! change while they are decoded (a file rewritten in place, a shared mmap), so the
//! decoding pass trusts no earlier look at them: it reads through `reader::Reader`,
//! whose checks are the flatbuffers verifier's, on every field the verifier visits (the
//! fields the checkpoint does not use included). The verifier itself runs only when that
//! pass fails, to word the error of a file that is malformed as it stands.

use flatbuffers::VerifierOptions;

use super::dtype::{element_count, DataType};
use super::model::{
    Checkpoint, OptimizerGroup, ParameterOptimizerState, PropertyBag, Stored, Tensor,
};
use super::names::first_clash;
use super::reader::{List, Reader, Table};
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
/// duplicate names), and for bytes that changed while they were read;
/// [`ErrorKind::UnsupportedDataType`] for unknown type codes.
pub fn decode(buf: &[u8]) -> Result<Checkpoint<Stored>> {
    if buf.len() < MIN_LEN {
        return Err(Error::malformed(format!(
            "file is too short to be a checkpoint ({} bytes)",
            buf.len()
        )));
    }
    // A copy: text made from bytes that change while it is made may not be UTF-8.
    let identifier = Reader::new(buf, &verifier_options(buf.len())).identifier()?;
    if identifier != *FILE_IDENTIFIER.as_bytes() {
        let looks = looks_like(buf)
            .map(|kind| format!(" ({kind})"))
            .unwrap_or_default();
        return Err(Error::malformed(format!(
            "not an ONNX Runtime training checkpoint: file identifier is {:?}, expected {:?}{looks}",
            String::from_utf8_lossy(&identifier),
            FILE_IDENTIFIER
        )));
    }
    // One pass over a well-formed file (a second, the verifier's, was a fifth of the load
    // of 16k small tensors); the verifier words the error of a malformed one. The pass may
    // allocate half the file's size: a file that refers to its metadata again and again (a
    // DAG) allocates more before its checks fail, so past that the verifier runs first, as
    // it always did (refusing such files before anything is allocated), then the pass.
    let r = &mut Reader::new(buf, &verifier_options(buf.len())).within(buf.len() / 2);
    match decode_from(r) {
        Ok(checkpoint) => Ok(checkpoint),
        Err(_) if r.over_budget() => match verifier_error(buf) {
            Some(e) => Err(e),
            None => decode_checked(buf),
        },
        Err(checked) => Err(verifier_error(buf).unwrap_or(checked)),
    }
}

/// The verifier's error on `buf`, worded for the user, or None when it passes (then the
/// bytes changed while the checked pass read them, or what is wrong is past its checks).
fn verifier_error(buf: &[u8]) -> Option<Error> {
    let e = verify_checkpoint(&verifier_options(buf.len()), buf).err()?;
    if let flatbuffers::InvalidFlatbuffer::RangeOutOfBounds { range, .. } = &e {
        if range.end > buf.len() {
            return Some(Error::malformed(format!(
                "checkpoint verification failed: the file ends at byte {}, before the end of what \
                 it records (byte {}): it is truncated",
                buf.len(),
                range.end
            )));
        }
    }
    // The verifier's message carries a multi-line trace; its first line says what failed.
    let first = e.to_string().lines().next().unwrap_or_default().to_owned();
    Some(Error::malformed(format!(
        "checkpoint verification failed: {first}"
    )))
}

/// What a file that is not a checkpoint seems to be, by its first bytes, for the message
/// that refuses it: the files people hand a checkpoint reader by mistake.
fn looks_like(buf: &[u8]) -> Option<&'static str> {
    let starts = |magic: &[u8]| buf.starts_with(magic);
    if starts(b"ORTCKPTZ") {
        Some("it is a compressed checkpoint (a manager's compress_kept): `ortckpt decompress` or a manager restores it")
    } else if starts(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Some("it looks like a zstd-compressed file")
    } else if starts(b"PK\x03\x04") {
        Some("it looks like a ZIP archive, as torch.save writes: `ortckpt convert` reads those")
    } else if buf.len() > 8
        && buf[8] == b'{'
        && u64::from_le_bytes(buf[..8].try_into().ok()?) < buf.len() as u64
    {
        Some("it looks like a safetensors file: `ortckpt convert` reads those")
    } else if buf[4..8] == *b"ORTM" {
        Some("it is an ONNX Runtime format model, not a checkpoint")
    } else if starts(&[0x08])
        && buf[1] < 0x80
        // (a ModelProto's fields in order after ir_version: producer_name ... opset_import)
        && [0x12, 0x1a, 0x22, 0x28, 0x32, 0x3a, 0x42].contains(&buf[2])
    {
        Some("it looks like an ONNX model: the training checkpoint is the `checkpoint` file beside the training \
              models; `ortckpt convert MODEL.onnx OUT.ckpt` makes one from a model's initializers")
    } else if buf.iter().take(4096).all(|b| *b == 0) {
        Some("its first bytes are all zero: a file never written, or zeroed")
    } else {
        None
    }
}

/// Decodes `buf` without relying on any earlier look at it: every read is checked as it
/// is made (see [`Reader`]), so bytes that change meanwhile give a consistent
/// checkpoint or a [`ErrorKind::Malformed`] error, never a panic. [`decode`] runs the
/// verifier first, for its messages; tests call this alone.
pub(crate) fn decode_checked(buf: &[u8]) -> Result<Checkpoint<Stored>> {
    decode_from(&mut Reader::new(buf, &verifier_options(buf.len())))
}

/// [`decode_checked`] through `r`.
fn decode_from(r: &mut Reader<'_>) -> Result<Checkpoint<Stored>> {
    let root = r.root(FILE_IDENTIFIER)?;
    let version = r.i32(root, fbs::Checkpoint::VT_VERSION, 0)?;
    if !(FIRST_CHECKPOINT_VERSION..=CHECKPOINT_VERSION).contains(&version) {
        return Err(Error::malformed(format!(
            "checkpoint version {version} is not supported (ONNX Runtime has written versions \
             {FIRST_CHECKPOINT_VERSION} and {CHECKPOINT_VERSION})"
        )));
    }

    let mut ckpt = Checkpoint {
        version,
        ..Checkpoint::default()
    };
    if let Some(module) = r.table(root, fbs::Checkpoint::VT_MODULE_STATE)? {
        use fbs::ModuleState as M;
        ckpt.is_nominal = r.bool(module, M::VT_IS_NOMINAL_STATE)?;
        ckpt.has_external_data = r.bool(module, M::VT_HAS_EXTERNAL_DATA)?;
        // Version 2 (ONNX Runtime 1.17) added both flags; a version-1 writer cannot set them.
        if version == 1 && (ckpt.is_nominal || ckpt.has_external_data) {
            return Err(Error::malformed(
                "a version-1 checkpoint cannot be nominal or have external data (version 2 added both)",
            ));
        }
        let trainable = r
            .list(module, M::VT_REQUIRES_GRAD_PARAMS)?
            .ok_or_else(|| Error::malformed("module state has no requires_grad_params vector"))?;
        let frozen = r
            .list(module, M::VT_FROZEN_PARAMS)?
            .ok_or_else(|| Error::malformed("module state has no frozen_params vector"))?;
        ckpt.trainable = tensors(r, trainable, Role::Trainable, &ckpt)?;
        ckpt.frozen = tensors(r, frozen, Role::Frozen, &ckpt)?;
    }
    if let Some(groups) = r.list(root, fbs::Checkpoint::VT_OPTIMIZER_GROUPS)? {
        for i in 0..groups.len {
            let group = r.table_in(groups, i)?;
            let decoded = optimizer_group(r, group, &ckpt)?;
            ckpt.optimizer_groups.push(decoded);
        }
    }
    if let Some(bag) = r.table(root, fbs::Checkpoint::VT_PROPERTY_BAG)? {
        ckpt.properties = properties(r, bag)?;
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
    // (in the data file?, start, end, which tensor): names are looked up only for the
    // error (making one per tensor cost more than the check, for 16k small tensors).
    let mut ranges: Vec<(bool, u64, u64, usize)> = ckpt
        .tensors_named_lazily()
        .enumerate()
        .filter_map(|(i, t)| match t.data {
            Stored::Inline { offset, len } if len > 0 => {
                Some((false, offset as u64, (offset + len) as u64, i))
            }
            Stored::External { offset, len } if len > 0 => {
                Some((true, offset, offset.saturating_add(len), i))
            }
            _ => None,
        })
        .collect();
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        if a.0 == b.0 && b.1 < a.2 {
            let name = |i: usize| {
                ckpt.tensors_named()
                    .nth(i)
                    .map(|(n, _)| n)
                    .unwrap_or_default()
            };
            let (a_name, b_name) = (name(a.3), name(b.3));
            return Err(Error::malformed(format!(
                "the values of {} and {} overlap ({} bytes {}..{} and {}..{})",
                a_name,
                b_name,
                if a.0 { "external data" } else { "file" },
                a.1,
                a.2,
                b.1,
                b.2
            ))
            .in_tensor(&b_name));
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

fn tensors(
    r: &mut Reader<'_>,
    list: List,
    role: Role,
    ckpt: &Checkpoint<Stored>,
) -> Result<Vec<Tensor<Stored>>> {
    let mut out = Vec::new();
    for i in 0..list.len {
        r.charge(std::mem::size_of::<Tensor<Stored>>())?;
        let t = r.table_in(list, i)?;
        out.push(tensor(r, t, i, role, ckpt)?);
    }
    Ok(out)
}

fn tensor(
    r: &mut Reader<'_>,
    t: Table,
    index: usize,
    role: Role,
    ckpt: &Checkpoint<Stored>,
) -> Result<Tensor<Stored>> {
    use fbs::Tensor as T;
    let name = r
        .string(t, T::VT_NAME)?
        .ok_or_else(|| Error::malformed(format!("{} tensor #{index} has no name", role.label())))?;
    let in_tensor = |e: Error| e.in_tensor(&name);
    let dims = r
        .int64s(t, T::VT_DIMS)
        .and_then(|dims| dims.ok_or_else(|| Error::malformed("tensor has no dims")))
        .map_err(in_tensor)?;
    let code = r.i32(t, T::VT_DATA_TYPE, 0).map_err(in_tensor)?;
    let data_type = DataType::from_code(code).map_err(in_tensor)?;
    if data_type == DataType::Undefined {
        return Err(Error::new(ErrorKind::UnsupportedDataType(0)).in_tensor(&name));
    }
    let data = if ckpt.is_nominal {
        Stored::Absent
    } else {
        values(r, t, data_type, &dims, ckpt.has_external_data).map_err(in_tensor)?
    };
    unused_fields(r, t, &data).map_err(in_tensor)?;
    Ok(Tensor {
        name,
        data_type,
        dims,
        data,
    })
}

/// The fields of a tensor that its values did not need, checked as the verifier checks them
/// (so that this pass refuses what it refuses): the doc string, and whichever of raw_data,
/// string_data and external_data_offset were not read. Absent in the files seen so far.
fn unused_fields(r: &mut Reader<'_>, t: Table, data: &Stored) -> Result<()> {
    use fbs::Tensor as T;
    r.string(t, T::VT_DOC_STRING)?;
    // (raw_data read?, string_data read?, external_data_offset read?)
    let read = match data {
        Stored::Inline { .. } => (true, false, true),
        Stored::External { .. } => (false, false, true),
        Stored::Strings(_) => (false, true, false),
        Stored::Absent => (false, false, false),
    };
    if !read.0 {
        r.byte_range(t, T::VT_RAW_DATA)?;
    }
    if !read.1 {
        if let Some(strings) = r.list(t, T::VT_STRING_DATA)? {
            for i in 0..strings.len {
                r.string_in(strings, i)?;
            }
        }
    }
    if !read.2 {
        r.i64(t, T::VT_EXTERNAL_DATA_OFFSET, -1)?;
    }
    Ok(())
}

fn values(
    r: &mut Reader<'_>,
    t: Table,
    data_type: DataType,
    dims: &[i64],
    has_external_data: bool,
) -> Result<Stored> {
    use fbs::Tensor as T;
    let count = element_count(dims, data_type).map_err(Error::malformed)?;
    if data_type == DataType::String {
        let strings = r
            .list(t, T::VT_STRING_DATA)?
            .ok_or_else(|| Error::malformed("STRING tensor has no string_data"))?;
        if strings.len as u64 != count {
            return Err(Error::malformed(format!(
                "string_data holds {} strings but dims {dims:?} need {count}",
                strings.len
            )));
        }
        let values = (0..strings.len)
            .map(|i| r.string_in(strings, i))
            .collect::<Result<_>>()?;
        return Ok(Stored::Strings(values));
    }
    let expected = data_type.byte_len(count).ok_or_else(|| {
        Error::malformed(format!(
            "dims {dims:?} of {} overflow the byte length",
            data_type.name()
        ))
    })?;
    let offset = r.i64(t, T::VT_EXTERNAL_DATA_OFFSET, -1)?;
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
    // The values stay where they are: a byte range of the buffer.
    let (start, len) = r
        .byte_range(t, T::VT_RAW_DATA)?
        .ok_or_else(|| Error::malformed("tensor has neither raw_data nor external data"))?;
    if len as u64 != expected {
        return Err(Error::malformed(format!(
            "raw_data holds {len} bytes but dims {dims:?} of {} need {expected}",
            data_type.name()
        )));
    }
    Ok(Stored::Inline { offset: start, len })
}

fn optimizer_group(
    r: &mut Reader<'_>,
    g: Table,
    ckpt: &Checkpoint<Stored>,
) -> Result<OptimizerGroup<Stored>> {
    use fbs::OptimizerGroup as G;
    use fbs::ParameterOptimizerState as S;
    let name = r
        .string(g, G::VT_GROUP_NAME)?
        .ok_or_else(|| Error::malformed("optimizer group has no name"))?;
    let mut states = Vec::new();
    if let Some(list) = r.list(g, G::VT_OPTIMIZER_STATES)? {
        for i in 0..list.len {
            let s = r.table_in(list, i)?;
            let param_name = r.string(s, S::VT_PARAM_NAME)?.ok_or_else(|| {
                Error::malformed(format!(
                    "optimizer group '{name}': state #{i} has no param_name"
                ))
            })?;
            let momentums = match r.list(s, S::VT_MOMENTUMS)? {
                Some(list) => tensors(r, list, Role::Momentum, ckpt)
                    .map_err(|e| e.in_tensor_scope(&format!("{name}/{param_name}")))?,
                None => Vec::new(),
            };
            states.push(ParameterOptimizerState {
                param_name,
                momentums,
            });
        }
    }
    Ok(OptimizerGroup {
        step: r.i64(g, G::VT_STEP, 0)?,
        initial_learning_rate: r.f32(g, G::VT_INITIAL_LEARNING_RATE, 0.0)?,
        name,
        states,
    })
}

fn properties(r: &mut Reader<'_>, bag: Table) -> Result<PropertyBag> {
    use fbs::PropertyBag as B;
    let missing = |kind: &str, i: usize, what: &str| {
        Error::malformed(format!("{kind} property #{i} has no {what}"))
    };
    let mut out = PropertyBag::default();
    if let Some(list) = r.list(bag, B::VT_INTS)? {
        for i in 0..list.len {
            let p = r.table_in(list, i)?;
            let name = r
                .string(p, fbs::IntProperty::VT_NAME)?
                .ok_or_else(|| missing("int", i, "name"))?;
            out.ints
                .push((name, r.i64(p, fbs::IntProperty::VT_VALUE, 0)?));
        }
    }
    if let Some(list) = r.list(bag, B::VT_FLOATS)? {
        for i in 0..list.len {
            let p = r.table_in(list, i)?;
            let name = r
                .string(p, fbs::FloatProperty::VT_NAME)?
                .ok_or_else(|| missing("float", i, "name"))?;
            out.floats
                .push((name, r.f32(p, fbs::FloatProperty::VT_VALUE, 0.0)?));
        }
    }
    if let Some(list) = r.list(bag, B::VT_STRINGS)? {
        for i in 0..list.len {
            let p = r.table_in(list, i)?;
            let name = r
                .string(p, fbs::StringProperty::VT_NAME)?
                .ok_or_else(|| missing("string", i, "name"))?;
            let value = r
                .string(p, fbs::StringProperty::VT_VALUE)?
                .ok_or_else(|| missing("string", i, "value"))?;
            out.strings.push((name, value));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::path::Path;

    use flatbuffers::FlatBufferBuilder;

    use super::*;

    /// Every checkpoint ONNX Runtime wrote for the golden tests, versions 1 and 2.
    fn goldens() -> Vec<(String, Vec<u8>)> {
        fn walk(dir: &Path, out: &mut Vec<(String, Vec<u8>)>) {
            for entry in std::fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
                if path.is_dir() {
                    walk(&path, out);
                } else if !matches!(ext, "json" | "md" | "onnx") {
                    out.push((path.display().to_string(), std::fs::read(&path).unwrap()));
                }
            }
        }
        let mut out = Vec::new();
        walk(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/ort-vectors"),
            &mut out,
        );
        out.sort();
        assert!(out.len() >= 29, "{} golden files", out.len());
        out
    }

    /// SplitMix64: a fixed sequence, so a failure reproduces.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// The checked pass alone on `buf`, as it would see bytes that changed after the
    /// verifier's pass: it must decode or fail typed, never panic. On bytes the verifier
    /// accepts, it must not claim they changed (its checks are the verifier's).
    fn check(buf: &[u8], what: impl Fn() -> String) {
        let Ok(checked) = catch_unwind(AssertUnwindSafe(|| decode_checked(buf))) else {
            panic!("the checked decoder panicked on {}", what());
        };
        // One pass: what it accepts, the verifier accepts (decode runs the verifier only
        // when the checked pass fails).
        if checked.is_ok() {
            assert!(
                verify_checkpoint(&verifier_options(buf.len()), buf).is_ok(),
                "{}: the checked pass accepts what the verifier refuses",
                what()
            );
        }
        if let Err(e) = &checked {
            assert!(
                matches!(
                    e.kind(),
                    ErrorKind::Malformed(_) | ErrorKind::UnsupportedDataType(_)
                ),
                "{}: {e:?}",
                what()
            );
            // What decode checks before the checked pass.
            let verified = fbs::checkpoint_buffer_has_identifier(buf)
                && verify_checkpoint(&verifier_options(buf.len()), buf).is_ok();
            assert!(
                !(verified && e.to_string().contains("changed while")),
                "{}: the verifier passed, yet: {e}",
                what()
            );
        }
    }

    #[test]
    fn the_checked_decoder_survives_every_byte_of_every_golden_file_changed() {
        for (name, original) in goldens() {
            let mut buf = original.clone();
            for pos in 0..buf.len() {
                let was = original[pos];
                for value in [
                    0x00,
                    0xFF,
                    0x7F,
                    0x80,
                    was ^ 0x01,
                    was ^ 0x10,
                    was.wrapping_add(4),
                ] {
                    buf[pos] = value;
                    check(&buf, || format!("{name} with byte {pos} = {value:#04x}"));
                }
                buf[pos] = was;
            }
            // The file itself decodes alike both ways.
            assert_eq!(
                decode_checked(&original).unwrap(),
                decode(&original).unwrap(),
                "{name}"
            );
        }
    }

    #[test]
    fn the_checked_decoder_survives_random_changes_to_golden_files() {
        let mut rng = Rng(0x0DDC_0FFE);
        for (name, original) in goldens() {
            for round in 0..3000 {
                let mut buf = original.clone();
                let len = buf.len();
                for _ in 0..1 + rng.below(8) {
                    if rng.below(2) == 0 {
                        buf[rng.below(len)] = rng.next() as u8;
                    } else {
                        // An offset or length somewhere: small, near the size, or anything.
                        let at = rng.below(len / 4) * 4;
                        let value = match rng.below(3) {
                            0 => rng.below(64) as u32,
                            1 => (len + rng.below(16)).wrapping_sub(8) as u32,
                            _ => rng.next() as u32,
                        };
                        buf[at..at + 4].copy_from_slice(&value.to_le_bytes());
                    }
                }
                check(&buf, || format!("{name}, random round {round}"));
            }
        }
    }

    #[test]
    fn a_name_that_stops_being_utf8_is_an_error_in_the_checked_pass() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/ort-vectors/protos.ckpt"
        );
        let mut buf = std::fs::read(path).unwrap();
        let at = buf
            .windows(b"encoder.bias".len())
            .position(|w| w == b"encoder.bias")
            .unwrap();
        buf[at] = 0xFF;
        let verified = decode(&buf).unwrap_err().to_string();
        assert!(
            verified.starts_with("checkpoint verification failed: Utf8 error"),
            "{verified}"
        );
        let checked = decode_checked(&buf).unwrap_err().to_string();
        assert!(
            checked.starts_with("the checkpoint changed while it was being read (the string at")
                && checked.contains("is not UTF-8"),
            "{checked}"
        );
    }

    /// A checkpoint of one float tensor `t` of 2 elements, with a doc string, as `tensor`
    /// builds it from (name, doc string, dims) offsets.
    fn one_tensor_file(
        nominal: bool,
        tensor: impl FnOnce(&mut FlatBufferBuilder<'static>) -> fbs::TensorArgs<'static>,
    ) -> Vec<u8> {
        let mut fbb = FlatBufferBuilder::new();
        let args = tensor(&mut fbb);
        let tensor = fbs::Tensor::create(&mut fbb, &args);
        let params = fbb.create_vector(&[tensor]);
        let none = fbb.create_vector::<flatbuffers::WIPOffset<fbs::Tensor>>(&[]);
        let module = fbs::ModuleState::create(
            &mut fbb,
            &fbs::ModuleStateArgs {
                requires_grad_params: Some(params),
                frozen_params: Some(none),
                is_nominal_state: nominal,
                ..Default::default()
            },
        );
        let root = fbs::Checkpoint::create(
            &mut fbb,
            &fbs::CheckpointArgs {
                version: CHECKPOINT_VERSION,
                module_state: Some(module),
                ..Default::default()
            },
        );
        fbb.finish(root, Some(FILE_IDENTIFIER));
        fbb.finished_data().to_vec()
    }

    #[test]
    fn fields_the_checkpoint_does_not_use_are_refused_as_the_verifier_refuses_them() {
        // The one pass checks what the verifier checks: a doc string that is not UTF-8, and
        // the raw_data of a nominal tensor that lies past the end, are refused with the
        // verifier's message (which runs once the pass has failed), as before.
        let with_doc = |nominal: bool| {
            one_tensor_file(nominal, |fbb| {
                let name = fbb.create_string("t");
                let doc = fbb.create_string("DOCSTRING");
                let dims = fbb.create_vector(&[2i64]);
                let raw = fbb.create_vector(&[0u8; 8]);
                fbs::TensorArgs {
                    name: Some(name),
                    doc_string: Some(doc),
                    dims: Some(dims),
                    data_type: fbs::TensorDataType::FLOAT,
                    raw_data: Some(raw),
                    ..Default::default()
                }
            })
        };
        let good = with_doc(false);
        assert!(matches!(
            decode(&good).unwrap().trainable[0].data,
            Stored::Inline { len: 8, .. }
        ));
        let mut bad = good.clone();
        let at = bad.windows(9).position(|w| w == b"DOCSTRING").unwrap();
        bad[at] = 0xFF;
        let e = decode(&bad).unwrap_err().to_string();
        assert!(
            e.starts_with("checkpoint verification failed: Utf8 error"),
            "{e}"
        );
        assert!(decode_checked(&bad).is_err());

        let mut nominal = with_doc(true);
        assert!(decode(&nominal).unwrap().is_nominal);
        // The raw_data vector's length (the 4 bytes before its 8 zeros) made far too long.
        let len_at = nominal
            .windows(12)
            .position(|w| w == [8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])
            .unwrap();
        nominal[len_at..len_at + 4].copy_from_slice(&1_000_000u32.to_le_bytes());
        let e = decode(&nominal).unwrap_err().to_string();
        assert!(e.starts_with("checkpoint verification failed"), "{e}");
        assert!(decode_checked(&nominal).is_err());
    }

    #[test]
    fn the_checked_pass_bounds_the_work_of_a_dag_of_offsets_to_one_big_tensor() {
        // 20,000 references to one tensor with 1,000 dims: about 100 KB that would
        // decode to 160 MB of dims. The checked pass alone refuses it, as the verifier does.
        let mut fbb = FlatBufferBuilder::new();
        let name = fbb.create_string("t");
        let dims = fbb.create_vector(&[1i64; 1000]);
        let tensor = fbs::Tensor::create(
            &mut fbb,
            &fbs::TensorArgs {
                name: Some(name),
                dims: Some(dims),
                data_type: fbs::TensorDataType::FLOAT,
                ..Default::default()
            },
        );
        let params = fbb.create_vector(&vec![tensor; 20_000]);
        let none = fbb.create_vector::<flatbuffers::WIPOffset<fbs::Tensor>>(&[]);
        let module = fbs::ModuleState::create(
            &mut fbb,
            &fbs::ModuleStateArgs {
                requires_grad_params: Some(params),
                frozen_params: Some(none),
                is_nominal_state: true,
                ..Default::default()
            },
        );
        let root = fbs::Checkpoint::create(
            &mut fbb,
            &fbs::CheckpointArgs {
                version: CHECKPOINT_VERSION,
                module_state: Some(module),
                ..Default::default()
            },
        );
        fbb.finish(root, Some(FILE_IDENTIFIER));
        let buf = fbb.finished_data();
        assert!(decode(buf).is_err());
        let e = decode_checked(buf).unwrap_err().to_string();
        assert!(e.contains("it refers to more bytes than it holds"), "{e}");
    }
}
