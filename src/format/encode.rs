//! Checkpoint -> bytes, without ever holding the tensor values in a buffer.
//!
//! The flatbuffers builder lays out the whole file, but the tensor bytes are only
//! *reserved* (a zero-sized placeholder element, so nothing is written and the
//! reserved pages of the anonymous mapping behind the builder stay untouched).
//! The result is the metadata with holes plus, for every hole, the caller's slice
//! that fills it; the I/O layer writes both in file order, so each tensor byte is
//! copied once, from the caller's memory to the file.
//!
//! The values are reserved first, as one region, so they sit together at the end
//! of the file and the metadata together at its start: opening touches only the
//! first pages. Inside that region this module places each value's vector itself
//! (length prefix, then the 64-byte-aligned bytes) and hands the tables offsets to
//! them. Letting the builder write each prefix would touch one page of the mapping
//! per tensor, which measured 1.5 µs a tensor (25 ms for 16,384 tensors); the
//! prefixes are kept in a small side buffer instead.
//!
//! With [`Placement::External`], values of [`EXTERNAL_MIN_BYTES`] or more go to the
//! external data file (`<checkpoint>.data`) instead, at 64-byte-aligned offsets, and
//! the flatbuffer records only their offsets: the layout ONNX Runtime uses beyond 2 GiB.

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use flatbuffers::{FlatBufferBuilder, Push, PushAlignment, Vector, WIPOffset};
use memmap2::MmapMut;

use super::dtype::{element_count, DataType};
use super::model::{Checkpoint, Payload, Tensor};
use super::pairing::{self, PAIR_TRAILER_LEN};
use super::{first_duplicate, CHECKPOINT_VERSION};
use crate::error::{Error, ErrorKind, Result};
use crate::generated::onnxruntime::fbs;

/// Tensor values start at multiples of this (a cache line; enough for any dtype and SIMD).
pub const PAYLOAD_ALIGNMENT: usize = 64;

/// ONNX Runtime verifies inline checkpoints with a 2^31-1 byte limit.
pub const MAX_INLINE_LEN: u64 = i32::MAX as u64;

/// With external data, smaller values stay inline (as in ONNX Runtime, which keeps
/// tensors under 64 bytes, empty ones and strings in the flatbuffer).
pub const EXTERNAL_MIN_BYTES: usize = 64;

/// Where tensor values are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Inside the flatbuffer (files up to 2 GiB).
    Inline,
    /// In the external data file, but for values under [`EXTERNAL_MIN_BYTES`].
    External,
}

/// Where one tensor's values go.
#[derive(Clone, Copy)]
enum Slot<'f> {
    /// No bytes to place (strings, empty or nominal tensors).
    Nothing,
    /// Reserved inside the flatbuffer.
    Inline(WIPOffset<Vector<'f, u8>>),
    /// At this offset of the external data file.
    External(u64),
}

/// An encoded checkpoint: metadata with holes, and the bytes that fill them.
pub struct Encoded<'a> {
    buffer: AnonBuffer,
    /// Where the finished flatbuffer starts inside `buffer`.
    start: usize,
    /// (offset in the file, bytes): ascending, non-overlapping.
    payloads: Vec<(usize, &'a [u8])>,
    /// Where the inline values' region starts in the file (the builder wrote
    /// everything before it), and its length.
    region_start: usize,
    region_len: usize,
    /// The region's bytes after the last value: zero padding, then the pair
    /// trailer when the checkpoint has external data.
    region_tail: Vec<u8>,
    /// What precedes each value in the region (padding, then its length prefix),
    /// which the builder's buffer leaves unwritten: value `i`'s gap ends at
    /// `gap_ends[i]` and starts where value `i - 1`'s ends (or at 0).
    gaps: Vec<u8>,
    gap_ends: Vec<usize>,
    /// (offset in the external data file, bytes): ascending, non-overlapping.
    external: Vec<(u64, &'a [u8])>,
    external_len: u64,
    has_external_data: bool,
    /// The end of both files of an external pair (see [`super::pairing`]).
    pair_trailer: Option<[u8; PAIR_TRAILER_LEN]>,
}

impl<'a> Encoded<'a> {
    /// Size of the file.
    pub fn len(&self) -> usize {
        self.buffer.len() - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Offsets and lengths of the tensor values in the file, ascending.
    pub fn payload_ranges(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.payloads.iter().map(|&(at, bytes)| (at, bytes.len()))
    }

    /// Whether the checkpoint needs its external data file.
    pub fn has_external_data(&self) -> bool {
        self.has_external_data
    }

    /// The external data file's size and its contents by offset (gaps are zero
    /// padding): the values, then the pair trailer.
    pub fn external_data(&self) -> (u64, Vec<(u64, &[u8])>) {
        let mut parts: Vec<(u64, &[u8])> = self.external.clone();
        let mut len = self.external_len;
        if let Some(trailer) = &self.pair_trailer {
            parts.push((len, trailer));
            len += trailer.len() as u64;
        }
        (len, parts)
    }

    /// The file's bytes as consecutive slices: metadata from the builder, values from the caller.
    pub fn segments(&self) -> Vec<&[u8]> {
        let metadata = &self.buffer[self.start..];
        let mut out = Vec::with_capacity(2 * self.payloads.len() + 3);
        out.push(&metadata[..self.region_start]);
        let mut gap_start = 0;
        for (&(_, bytes), &gap_end) in self.payloads.iter().zip(&self.gap_ends) {
            out.push(&self.gaps[gap_start..gap_end]);
            out.push(bytes);
            gap_start = gap_end;
        }
        out.push(&self.region_tail);
        // The builder's alignment padding after the region, if any.
        out.push(&metadata[(self.region_start + self.region_len).min(metadata.len())..]);
        out.retain(|s| !s.is_empty());
        out
    }
}

/// Lays out `ckpt` exactly as given (call [`Checkpoint::sort_like_ort_state_path`]
/// first for ONNX Runtime's state-path order).
///
/// # Errors
/// [`ErrorKind::InvalidState`] when a tensor's bytes disagree with its dims, names
/// repeat, or the values exceed what an inline checkpoint holds;
/// [`ErrorKind::UnsupportedDataType`] for UNDEFINED tensors.
pub fn encode<'a>(ckpt: &Checkpoint<Payload<'a>>, placement: Placement) -> Result<Encoded<'a>> {
    validate(ckpt)?;
    let tensors: Vec<&Tensor<Payload<'a>>> = ckpt.tensors().collect();
    let has_external_data = placement == Placement::External && !ckpt.is_nominal;

    // External values first: the data file holds them in tensor order.
    let mut slots = vec![Slot::Nothing; tensors.len()];
    let mut external = Vec::new();
    let mut external_len = 0u64;
    let mut inline_len = 0u64;
    for (slot, t) in slots.iter_mut().zip(&tensors) {
        match t.data {
            Payload::Bytes(bytes) if !ckpt.is_nominal => {
                if has_external_data && bytes.len() >= EXTERNAL_MIN_BYTES {
                    let offset = external_len.next_multiple_of(PAYLOAD_ALIGNMENT as u64);
                    *slot = Slot::External(offset);
                    external.push((offset, bytes));
                    external_len = offset + bytes.len() as u64;
                } else {
                    inline_len += bytes.len() as u64;
                }
            }
            _ => {}
        }
    }
    if inline_len > MAX_INLINE_LEN {
        return Err(too_large(inline_len));
    }

    // The inline values' region, in tensor order: where each value starts in it,
    // aligned, with room for its length prefix before it (the region itself starts
    // aligned in the file). An external pair's trailer ends the region, and with
    // it the file.
    let mut values_end = 0usize;
    let mut inline_values = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        if let (Slot::Nothing, Payload::Bytes(bytes)) = (slots[i], &t.data) {
            if !bytes.is_empty() && !ckpt.is_nominal {
                let start = (values_end + 4).next_multiple_of(PAYLOAD_ALIGNMENT);
                inline_values.push((i, start, *bytes));
                values_end = start + bytes.len();
            }
        }
    }
    let pair_trailer = has_external_data.then(|| pairing::trailer(&pairing::new_pair_id()));
    let region_len = match pair_trailer {
        // A multiple of the alignment, so the builder pads nothing after it.
        Some(_) => (values_end + PAIR_TRAILER_LEN).next_multiple_of(PAYLOAD_ALIGNMENT),
        None => values_end,
    };
    let mut region_tail = vec![0u8; region_len - values_end];
    if let Some(trailer) = &pair_trailer {
        region_tail[region_len - values_end - PAIR_TRAILER_LEN..].copy_from_slice(trailer);
    }

    let mut fbb =
        FlatBufferBuilder::new_in(AnonBuffer::new(capacity_bound(ckpt, inline_len as usize))?);
    // Reserved first, so the region lands at the end of the flatbuffer. It is one
    // vector to the builder (its own length prefix stays unreferenced); the tables
    // refer to the values' vectors inside it, whose prefixes go to `gaps`.
    let mut gaps = Vec::new();
    let mut gap_ends = Vec::with_capacity(inline_values.len());
    let mut holes = Vec::with_capacity(inline_values.len());
    let mut region_from_end = 0;
    if region_len > 0 {
        // Offsets count from the buffer's end to a vector's length prefix.
        region_from_end = reserve(&mut fbb, region_len).value() as usize - 4;
        let mut at = 0;
        for &(i, start, bytes) in &inline_values {
            gaps.resize(gaps.len() + (start - 4 - at), 0);
            // Fits: inline values total under 2^31 bytes (checked above).
            gaps.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
            gap_ends.push(gaps.len());
            let prefix_from_end = (region_from_end - start + 4) as u32;
            slots[i] = Slot::Inline(WIPOffset::new(prefix_from_end));
            holes.push((prefix_from_end, bytes));
            at = start + bytes.len();
        }
    }

    let mut tables = tensors
        .iter()
        .zip(slots)
        .map(|(t, slot)| write_tensor(&mut fbb, t, slot, ckpt.is_nominal))
        .collect::<Vec<_>>()
        .into_iter();
    let trainable: Vec<_> = tables.by_ref().take(ckpt.trainable.len()).collect();
    let frozen: Vec<_> = tables.by_ref().take(ckpt.frozen.len()).collect();

    let mut groups = Vec::with_capacity(ckpt.optimizer_groups.len());
    for g in &ckpt.optimizer_groups {
        let mut states = Vec::with_capacity(g.states.len());
        for s in &g.states {
            let momentums: Vec<_> = tables.by_ref().take(s.momentums.len()).collect();
            let momentums = fbb.create_vector(&momentums);
            let param_name = fbb.create_string(&s.param_name);
            let args = fbs::ParameterOptimizerStateArgs {
                param_name: Some(param_name),
                momentums: Some(momentums),
            };
            states.push(fbs::ParameterOptimizerState::create(&mut fbb, &args));
        }
        let optimizer_states = fbb.create_vector(&states);
        let group_name = fbb.create_string(&g.name);
        let args = fbs::OptimizerGroupArgs {
            group_name: Some(group_name),
            step: g.step,
            initial_learning_rate: g.initial_learning_rate,
            optimizer_states: Some(optimizer_states),
        };
        groups.push(fbs::OptimizerGroup::create(&mut fbb, &args));
    }
    // ONNX Runtime's state path always writes this vector, empty or not.
    let optimizer_groups = Some(fbb.create_vector(&groups));

    // The external-data and nominal flags live in the module state, so it is written
    // whenever one is set (a fuzzer found a nominal state without parameters losing its flag).
    let module_state =
        if trainable.is_empty() && frozen.is_empty() && !has_external_data && !ckpt.is_nominal {
            None
        } else {
            let args = fbs::ModuleStateArgs {
                requires_grad_params: Some(fbb.create_vector(&trainable)),
                frozen_params: Some(fbb.create_vector(&frozen)),
                is_nominal_state: ckpt.is_nominal,
                has_external_data,
            };
            Some(fbs::ModuleState::create(&mut fbb, &args))
        };
    let property_bag = (!ckpt.properties.is_empty()).then(|| write_properties(&mut fbb, ckpt));
    let args = fbs::CheckpointArgs {
        version: CHECKPOINT_VERSION,
        module_state,
        optimizer_groups,
        property_bag,
    };
    let root = fbs::Checkpoint::create(&mut fbb, &args);
    fbs::finish_checkpoint_buffer(&mut fbb, root);

    let (buffer, start) = fbb.collapse_in();
    let len = buffer.len() - start;
    if len as u64 > MAX_INLINE_LEN {
        return Err(too_large(len as u64));
    }
    // A reserved vector's offset counts from the buffer's end to its length prefix.
    let payloads: Vec<(usize, &[u8])> = holes
        .into_iter()
        .map(|(from_end, bytes)| (len - from_end as usize + 4, bytes))
        .collect();
    debug_assert!(payloads.windows(2).all(|w| w[0].0 < w[1].0));
    Ok(Encoded {
        buffer,
        start,
        payloads,
        region_start: len - region_from_end,
        region_len,
        region_tail,
        gaps,
        gap_ends,
        external,
        external_len,
        has_external_data,
        pair_trailer,
    })
}

/// Stands for one tensor byte that the builder must leave room for but not write.
#[derive(Clone, Copy)]
struct ReservedByte;

impl Push for ReservedByte {
    type Output = u8;

    unsafe fn push(&self, _dst: &mut [u8], _written_len: usize) {}

    fn alignment() -> PushAlignment {
        PushAlignment::new(PAYLOAD_ALIGNMENT)
    }
}

fn reserve<'f>(
    fbb: &mut FlatBufferBuilder<'f, AnonBuffer>,
    len: usize,
) -> WIPOffset<Vector<'f, u8>> {
    // SAFETY: ReservedByte is zero-sized, so a slice of any length of it occupies no
    // memory and a dangling, well-aligned pointer is a valid base for it.
    let placeholders: &[ReservedByte] =
        unsafe { std::slice::from_raw_parts(NonNull::dangling().as_ptr(), len) };
    fbb.create_vector(placeholders)
}

fn write_tensor<'f>(
    fbb: &mut FlatBufferBuilder<'f, AnonBuffer>,
    t: &Tensor<Payload<'_>>,
    slot: Slot<'f>,
    nominal: bool,
) -> WIPOffset<fbs::Tensor<'f>> {
    let name = fbb.create_string(&t.name);
    let mut string_data = None;
    let (mut raw_data, external_data_offset) = match slot {
        Slot::Inline(reserved) => (Some(reserved), -1),
        // Offsets fit: the data file is at most a few TiB, far below 2^63.
        Slot::External(offset) => (None, offset as i64),
        Slot::Nothing => (None, -1),
    };
    let dims = if nominal {
        // Nominal tensors keep name and type; dims and data are empty (as ONNX Runtime writes them).
        raw_data = Some(fbb.create_vector::<u8>(&[]));
        fbb.create_vector::<i64>(&[])
    } else {
        match &t.data {
            Payload::Strings(values) => {
                let offsets: Vec<_> = values.iter().map(|s| fbb.create_string(s)).collect();
                string_data = Some(fbb.create_vector(&offsets));
            }
            Payload::Bytes(_) | Payload::Absent => {
                // Empty tensors still need a (zero-length) raw_data vector: ONNX Runtime
                // rejects a tensor with neither raw_data nor external data.
                if external_data_offset < 0 && raw_data.is_none() {
                    raw_data = Some(fbb.create_vector::<u8>(&[]));
                }
            }
        }
        fbb.create_vector(&t.dims)
    };
    let args = fbs::TensorArgs {
        name: Some(name),
        doc_string: None,
        dims: Some(dims),
        data_type: fbs::TensorDataType(t.data_type.code()),
        raw_data,
        string_data,
        external_data_offset,
    };
    fbs::Tensor::create(fbb, &args)
}

fn write_properties<'f>(
    fbb: &mut FlatBufferBuilder<'f, AnonBuffer>,
    ckpt: &Checkpoint<Payload<'_>>,
) -> WIPOffset<fbs::PropertyBag<'f>> {
    let props = &ckpt.properties;
    let mut ints = Vec::with_capacity(props.ints.len());
    for (name, value) in &props.ints {
        let name = Some(fbb.create_string(name));
        ints.push(fbs::IntProperty::create(
            fbb,
            &fbs::IntPropertyArgs {
                name,
                value: *value,
            },
        ));
    }
    let mut floats = Vec::with_capacity(props.floats.len());
    for (name, value) in &props.floats {
        let name = Some(fbb.create_string(name));
        floats.push(fbs::FloatProperty::create(
            fbb,
            &fbs::FloatPropertyArgs {
                name,
                value: *value,
            },
        ));
    }
    let mut strings = Vec::with_capacity(props.strings.len());
    for (name, value) in &props.strings {
        let name = Some(fbb.create_string(name));
        let value = Some(fbb.create_string(value));
        strings.push(fbs::StringProperty::create(
            fbb,
            &fbs::StringPropertyArgs { name, value },
        ));
    }
    // ONNX Runtime writes all three vectors once the bag is present.
    let args = fbs::PropertyBagArgs {
        ints: Some(fbb.create_vector(&ints)),
        floats: Some(fbb.create_vector(&floats)),
        strings: Some(fbb.create_vector(&strings)),
    };
    fbs::PropertyBag::create(fbb, &args)
}

/// Checks everything the writer relies on, so the builder never sees bad input.
fn validate(ckpt: &Checkpoint<Payload<'_>>) -> Result<()> {
    for t in ckpt.tensors() {
        check_tensor(t, ckpt.is_nominal).map_err(|e| e.in_tensor(&t.name))?;
    }
    unique(
        ckpt.trainable
            .iter()
            .chain(&ckpt.frozen)
            .map(|t| t.name.as_str()),
        "parameter",
    )?;
    unique(
        ckpt.optimizer_groups.iter().map(|g| g.name.as_str()),
        "optimizer group",
    )?;
    for g in &ckpt.optimizer_groups {
        unique(
            g.states.iter().map(|s| s.param_name.as_str()),
            "optimizer state for parameter",
        )
        .map_err(|e| e.in_tensor_scope(&g.name))?;
        for s in &g.states {
            unique(s.momentums.iter().map(|m| m.name.as_str()), "momentum")
                .map_err(|e| e.in_tensor_scope(&format!("{}/{}", g.name, s.param_name)))?;
        }
    }
    Ok(())
}

fn check_tensor(t: &Tensor<Payload<'_>>, nominal: bool) -> Result<()> {
    if t.data_type == DataType::Undefined {
        return Err(Error::new(ErrorKind::UnsupportedDataType(0)));
    }
    if nominal {
        return Ok(());
    }
    let count = element_count(&t.dims, t.data_type).map_err(Error::invalid_state)?;
    match (&t.data, t.data_type) {
        (Payload::Strings(values), DataType::String) => {
            if values.len() as u64 != count {
                return Err(Error::invalid_state(format!(
                    "{} strings given for dims {:?} ({count} elements)",
                    values.len(),
                    t.dims
                )));
            }
        }
        (Payload::Bytes(bytes), dt) if dt != DataType::String => {
            let expected = dt.byte_len(count);
            if expected != Some(bytes.len() as u64) {
                return Err(Error::invalid_state(format!(
                    "{} bytes given but dims {:?} of {} need {}",
                    bytes.len(),
                    t.dims,
                    dt.name(),
                    expected.map_or("more than 2^64".to_owned(), |n| n.to_string())
                )));
            }
        }
        (Payload::Absent, _) => {
            return Err(Error::invalid_state(
                "tensor has no values (only nominal checkpoints may omit them)",
            ))
        }
        (_, dt) => {
            return Err(Error::invalid_state(format!(
                "{} tensors take {}",
                dt.name(),
                if dt == DataType::String {
                    "strings"
                } else {
                    "bytes"
                }
            )))
        }
    }
    Ok(())
}

fn unique<'a>(names: impl Iterator<Item = &'a str>, what: &str) -> Result<()> {
    match first_duplicate(names) {
        Some(name) => Err(Error::invalid_state(format!(
            "duplicate {what} name '{name}'"
        ))),
        None => Ok(()),
    }
}

fn too_large(len: u64) -> Error {
    Error::invalid_state(format!(
        "the checkpoint would hold {len} bytes of values inline, beyond the {MAX_INLINE_LEN} bytes an \
         ONNX Runtime flatbuffer can hold; save with external data (a lower external_data_threshold)"
    ))
}

/// An upper bound on the encoded size, so the builder's buffer never has to grow
/// (growing would copy, and touch the reserved pages).
fn capacity_bound(ckpt: &Checkpoint<Payload<'_>>, inline_values: usize) -> usize {
    let mut metadata = 4096usize;
    let mut values = inline_values;
    for t in ckpt.tensors() {
        // Room for each tensor's table, name, dims, and its values' alignment and length prefix.
        metadata += 160 + 2 * t.name.len() + 8 * t.dims.len();
        values += PAYLOAD_ALIGNMENT + 8;
        if let Payload::Strings(s) = &t.data {
            metadata += 16 + s.iter().map(|v| v.len() + 16).sum::<usize>();
        }
    }
    for g in &ckpt.optimizer_groups {
        metadata += 128 + 2 * g.name.len();
        metadata += g
            .states
            .iter()
            .map(|s| 64 + 2 * s.param_name.len())
            .sum::<usize>();
    }
    let p = &ckpt.properties;
    metadata += p.ints.iter().map(|(n, _)| 64 + 2 * n.len()).sum::<usize>();
    metadata += p
        .floats
        .iter()
        .map(|(n, _)| 64 + 2 * n.len())
        .sum::<usize>();
    metadata += p
        .strings
        .iter()
        .map(|(n, v)| 64 + 2 * (n.len() + v.len()))
        .sum::<usize>();
    values + 2 * metadata
}

/// The builder's buffer: an anonymous mapping, whose pages cost memory only once
/// written. Reserved tensor bytes are never written, so they cost nothing.
struct AnonBuffer(MmapMut);

impl AnonBuffer {
    fn new(len: usize) -> Result<Self> {
        Ok(AnonBuffer(MmapMut::map_anon(len.max(4096))?))
    }
}

impl Deref for AnonBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl DerefMut for AnonBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

// SAFETY: grow_downwards doubles the buffer and moves the old contents to its end,
// as the trait requires; len is the mapping's length.
unsafe impl flatbuffers::Allocator for AnonBuffer {
    type Error = std::io::Error;

    fn grow_downwards(&mut self) -> std::io::Result<()> {
        // Only reached if capacity_bound was wrong: correct, just slower.
        let old = self.0.len();
        let mut grown = MmapMut::map_anon(old * 2)?;
        grown[old..].copy_from_slice(&self.0);
        self.0 = grown;
        Ok(())
    }

    fn len(&self) -> usize {
        self.0.len()
    }
}
