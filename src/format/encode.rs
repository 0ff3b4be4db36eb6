//! Checkpoint -> bytes, without ever holding the tensor values in a buffer.
//!
//! [`super::plan`] decides where each tensor's bytes go; this module builds the flatbuffer
//! tables around them. The values are only *reserved* in the builder (a zero-sized
//! placeholder element, so nothing is written and the reserved pages of the anonymous mapping
//! behind the builder stay untouched). The result is the metadata with holes plus, for every
//! hole, the caller's slice that fills it; the I/O layer writes both in file order, so each
//! tensor byte is copied once, from the caller's memory to the file. With external data, the
//! flatbuffer records only the values' offsets in the data file.

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use flatbuffers::{FlatBufferBuilder, Push, PushAlignment, Vector, WIPOffset};
use memmap2::MmapMut;

use super::dtype::{element_count, DataType};
use super::model::{Checkpoint, Payload, Tensor};
use super::names::first_clash;
use super::plan::{plan, too_large, Slot};
pub use super::plan::{Placement, EXTERNAL_MIN_BYTES, MAX_INLINE_LEN, PAYLOAD_ALIGNMENT};
use super::CHECKPOINT_VERSION;
use crate::error::{Error, ErrorKind, Result};
use crate::generated::onnxruntime::fbs;
use crate::seal::checksums::{self, Running, Sum};
use crate::seal::pairing::{self, PAIR_TRAILER_LEN};

/// A tensor's values as the tables refer to them.
#[derive(Clone, Copy)]
enum Values<'f> {
    /// No bytes (strings, empty or nominal tensors).
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
    /// The region's bytes after the last value: zero padding, the checksum block
    /// (zeros until [`Encoded::seal`]), then the pair trailer.
    region_tail: Vec<u8>,
    /// Where the checksum block starts in `region_tail`.
    block_at: usize,
    /// Where each tensor's bytes are, in file order, for its checksum.
    sources: Vec<Source<'a>>,
    pair_id: pairing::PairId,
    /// What precedes each value in the region (padding, then its length prefix),
    /// which the builder's buffer leaves unwritten: value `i`'s gap ends at
    /// `gap_ends[i]` and starts where value `i - 1`'s ends (or at 0).
    gaps: Vec<u8>,
    gap_ends: Vec<usize>,
    /// (offset in the external data file, bytes): ascending, non-overlapping.
    external: Vec<(u64, &'a [u8])>,
    external_len: u64,
    has_external_data: bool,
    /// The end of the external data file (see [`crate::seal::pairing`]).
    pair_trailer: Option<[u8; PAIR_TRAILER_LEN]>,
}

/// Where a tensor's bytes are, for its checksum.
#[derive(Clone, Copy)]
enum Source<'a> {
    /// No bytes of its own (strings, nominal or empty tensors).
    Nothing,
    /// The `i`th of the inline values ([`Encoded::payload_ranges`]).
    Inline(usize),
    /// The `i`th of the external values ([`Encoded::external_data`]).
    External(usize),
    /// In a data file that is not written (shared): the caller's bytes, equal to it.
    Memory(&'a [u8]),
    /// In a data file that is not written (shared), its sum known already (the checkpoint
    /// that shares it with this one has it).
    Known(Sum),
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

    /// The address of each inline value's bytes (the caller's memory), in the order of
    /// [`Encoded::payload_ranges`].
    pub fn payload_addresses(&self) -> impl Iterator<Item = usize> + '_ {
        self.payloads
            .iter()
            .map(|&(_, bytes)| bytes.as_ptr() as usize)
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
    /// Its checksum block is as last sealed ([`Encoded::seal`], [`Encoded::seal_from_memory`]).
    pub fn segments(&self) -> Vec<&[u8]> {
        let mut out: Vec<&[u8]> = self.body().into_iter().map(|(bytes, _)| bytes).collect();
        out.extend(self.tail());
        out.retain(|s| !s.is_empty());
        out
    }

    /// The file before its checksum block, as consecutive slices, each inline value marked
    /// with its index in [`Encoded::payload_ranges`].
    pub fn body(&self) -> Vec<(&[u8], Option<usize>)> {
        let metadata = &self.buffer[self.start..];
        let mut out = Vec::with_capacity(2 * self.payloads.len() + 2);
        out.push((&metadata[..self.region_start], None));
        let mut gap_start = 0;
        for (i, (&(_, bytes), &gap_end)) in self.payloads.iter().zip(&self.gap_ends).enumerate() {
            out.push((&self.gaps[gap_start..gap_end], None));
            out.push((bytes, Some(i)));
            gap_start = gap_end;
        }
        out.push((&self.region_tail[..self.block_at], None));
        out
    }

    /// The file after [`Encoded::body`]: the checksum block and the pair trailer.
    pub fn tail(&self) -> Vec<&[u8]> {
        let metadata = &self.buffer[self.start..];
        // Nothing follows the region: it is reserved first, at the buffer's end, in whole
        // multiples of the alignment, so the trailer ends the file.
        debug_assert_eq!(self.region_start + self.region_len, metadata.len());
        vec![&self.region_tail[self.block_at..]]
    }

    /// Writes the checksum block from the sums of the inline values (in the order of
    /// [`Encoded::payload_ranges`]) and of the external ones (of [`Encoded::external_data`],
    /// its trailer excepted), taken as they were written.
    pub fn seal(&mut self, inline_sums: &[Sum], external_sums: &[Sum]) {
        let empty = checksums::sum(&[]);
        let sums: Vec<Sum> = self
            .sources
            .iter()
            .map(|source| match *source {
                Source::Nothing => empty,
                Source::Inline(i) => inline_sums[i],
                Source::External(i) => external_sums[i],
                Source::Memory(bytes) => checksums::sum(bytes),
                Source::Known(sum) => sum,
            })
            .collect();
        let mut metadata = Running::default();
        for (bytes, value) in self.body() {
            if value.is_none() {
                metadata.update(bytes);
            }
        }
        let metadata = metadata.finish();
        if !self.has_external_data {
            self.pair_id = checksums::content_id(&sums, metadata);
            let at = self.region_tail.len() - PAIR_TRAILER_LEN;
            self.region_tail[at..].copy_from_slice(&pairing::trailer(&self.pair_id));
        }
        let block = checksums::block(&sums, metadata, &self.pair_id);
        self.region_tail[self.block_at..self.block_at + block.len()].copy_from_slice(&block);
    }

    /// [`Encoded::seal`], the values summed from the caller's memory: for writers that hand
    /// the segments on (streams, buffers) rather than write them here.
    pub fn seal_from_memory(&mut self) {
        let inline: Vec<Sum> = self
            .payloads
            .iter()
            .map(|(_, b)| checksums::sum(b))
            .collect();
        let external: Vec<Sum> = self
            .external
            .iter()
            .map(|(_, b)| checksums::sum(b))
            .collect();
        self.seal(&inline, &external);
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
    encode_planned(
        ckpt,
        placement,
        &checksums::marked(pairing::new_pair_id()),
        &[],
        &[],
    )
}

/// Lays out `ckpt` to share an existing data file (whose pair id is `pair_id`): the tensors
/// with an offset in `shared` (by [`Checkpoint::tensors`] order) are external at that offset
/// of it, every other value is inline, and no data file is to be written
/// ([`Encoded::external_data`] is then only the trailer, which the data file already ends with).
/// A shared tensor with a sum in `sums` (same order) is sealed with it, not summed again.
///
/// # Errors
/// As [`encode`].
pub fn encode_sharing<'a>(
    ckpt: &Checkpoint<Payload<'a>>,
    pair_id: &pairing::PairId,
    shared: &[Option<u64>],
    sums: &[Option<Sum>],
) -> Result<Encoded<'a>> {
    encode_planned(ckpt, Placement::Inline, pair_id, shared, sums)
}

fn encode_planned<'a>(
    ckpt: &Checkpoint<Payload<'a>>,
    placement: Placement,
    pair_id: &pairing::PairId,
    shared: &[Option<u64>],
    sums: &[Option<Sum>],
) -> Result<Encoded<'a>> {
    validate(ckpt)?;
    let plan = plan(ckpt, placement, pair_id, shared)?;
    let (mut inline_count, mut external_count) = (0, 0);
    let sources = plan
        .slots
        .iter()
        .zip(ckpt.tensors())
        .enumerate()
        .map(|(i, (slot, t))| match (slot, &t.data) {
            (Slot::Nothing, _) => Source::Nothing,
            (Slot::Inline(_), _) => {
                inline_count += 1;
                Source::Inline(inline_count - 1)
            }
            // In a data file that exists already: summed from the caller's (equal) bytes.
            (Slot::External(_), Payload::Bytes(bytes))
                if shared.get(i).copied().flatten().is_some() =>
            {
                match sums.get(i).copied().flatten() {
                    Some(sum) => Source::Known(sum),
                    None => Source::Memory(bytes),
                }
            }
            (Slot::External(_), _) => {
                external_count += 1;
                Source::External(external_count - 1)
            }
        })
        .collect();
    let inline_len = plan.inline.iter().map(|(_, b)| b.len()).sum();
    let mut fbb = FlatBufferBuilder::new_in(AnonBuffer::new(capacity_bound(ckpt, inline_len))?);

    // The inline region is reserved first, so it lands at the end of the flatbuffer. It is
    // one vector to the builder (its own length prefix stays unreferenced); the tables refer
    // to the values' vectors inside it, whose prefixes the plan keeps in `gaps`.
    // Offsets count from the buffer's end to a vector's length prefix (the region is never
    // empty: the checksum block and the pair trailer end it).
    let region_from_end = reserve(&mut fbb, plan.region_len).value() as usize - 4;
    let prefix_from_end = |start: usize| (region_from_end - start + 4) as u32;
    let slots = plan.slots.iter().map(|slot| match *slot {
        Slot::Nothing => Values::Nothing,
        Slot::Inline(start) => Values::Inline(WIPOffset::new(prefix_from_end(start))),
        Slot::External(offset) => Values::External(offset),
    });
    let has_external_data = plan.has_external_data;

    let mut tables = ckpt
        .tensors()
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
    let payloads: Vec<(usize, &[u8])> = plan
        .inline
        .iter()
        .map(|&(start, bytes)| (len - prefix_from_end(start) as usize + 4, bytes))
        .collect();
    debug_assert!(payloads.windows(2).all(|w| w[0].0 < w[1].0));
    Ok(Encoded {
        buffer,
        start,
        payloads,
        region_start: len - region_from_end,
        region_len: plan.region_len,
        region_tail: plan.region_tail,
        block_at: plan.block_at,
        sources,
        pair_id: *pair_id,
        gaps: plan.gaps,
        gap_ends: plan.gap_ends,
        external: plan.external,
        external_len: plan.external_len,
        has_external_data,
        pair_trailer: plan.pair_trailer,
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
    slot: Values<'f>,
    nominal: bool,
) -> WIPOffset<fbs::Tensor<'f>> {
    let name = fbb.create_string(&t.name);
    let mut string_data = None;
    let (mut raw_data, external_data_offset) = match slot {
        Values::Inline(reserved) => (Some(reserved), -1),
        // Offsets fit: the data file is at most a few TiB, far below 2^63.
        Values::External(offset) => (None, offset as i64),
        Values::Nothing => (None, -1),
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
    match first_clash(ckpt) {
        Some(clash) => Err(clash.into_error(Error::invalid_state)),
        None => Ok(()),
    }
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

/// An upper bound on the encoded size, so the builder's buffer never has to grow
/// (growing would copy, and touch the reserved pages).
fn capacity_bound(ckpt: &Checkpoint<Payload<'_>>, inline_values: usize) -> usize {
    let mut metadata = 4096usize;
    // The region's end: its padding, the checksum block and the pair trailer.
    let tail = PAYLOAD_ALIGNMENT + checksums::tail_len(ckpt.tensors().count());
    let mut values = inline_values + tail;
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
