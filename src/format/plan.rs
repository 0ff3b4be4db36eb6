//! Where each tensor's bytes go, decided before any table is built.
//!
//! A pure function of the checkpoint, the placement and the pair id: no flatbuffers builder,
//! no I/O. [`super::encode`] then builds the tables around the holes this plan leaves.
//!
//! Inline values sit together in one region at the end of the flatbuffer (so opening a file
//! touches only its first pages), each as a flatbuffers vector: zero padding, a 4-byte length
//! prefix, then the bytes, 64-byte aligned. The padding and prefixes are kept in a small side
//! buffer (`gaps`): written by the builder they would touch one page of its buffer per tensor.
//! With [`Placement::External`], values of [`EXTERNAL_MIN_BYTES`] or more go to the external
//! data file instead, at 64-byte-aligned offsets, and a pair trailer ends both files. Every
//! checkpoint file ends with room for its checksum block (see [`crate::seal::checksums`]) and its
//! pair trailer, after the values.
//! With `shared` offsets (a step that shares an existing data file, see [`crate::sharing`]),
//! those tensors are external at the offsets given, nothing is planned for the data file (it is
//! not written), every other value is inline, and the trailer carries that file's pair id.

use super::model::{Checkpoint, Payload};
use crate::error::{Error, Result};
use crate::seal::checksums;
use crate::seal::pairing::{self, PairId, PAIR_TRAILER_LEN};

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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// No bytes to place (strings, empty or nominal tensors).
    Nothing,
    /// In the inline values' region, its bytes starting this far into it.
    Inline(usize),
    /// At this offset of the external data file.
    External(u64),
}

/// The plan of one checkpoint's bytes.
pub struct Plan<'a> {
    /// One per tensor, in [`Checkpoint::tensors`] order.
    pub slots: Vec<Slot>,
    /// (start in the region, bytes) of each inline value, ascending.
    pub inline: Vec<(usize, &'a [u8])>,
    /// The region's length: the values, the checksum block and the pair trailer, padded to
    /// the alignment so the builder pads nothing after it.
    pub region_len: usize,
    /// What precedes each inline value in the region (padding, then its length prefix): value
    /// `i`'s gap ends at `gap_ends[i]` and starts where value `i - 1`'s ends (or at 0).
    pub gaps: Vec<u8>,
    pub gap_ends: Vec<usize>,
    /// The region's bytes after the last value: zero padding, the checksum block (zeros
    /// until sealed), then the pair trailer.
    pub region_tail: Vec<u8>,
    /// Where the checksum block starts in `region_tail`.
    pub block_at: usize,
    /// (offset in the external data file, bytes): ascending, non-overlapping.
    pub external: Vec<(u64, &'a [u8])>,
    pub external_len: u64,
    pub has_external_data: bool,
    /// The end of the external data file, when there is one (see [`crate::seal::pairing`]).
    pub pair_trailer: Option<[u8; PAIR_TRAILER_LEN]>,
}

/// Plans where `ckpt`'s tensor bytes go (the tensors must already be validated: bytes
/// matching dims). `pair_id` ties an external pair's two files together. `shared`, by
/// [`Checkpoint::tensors`] order (empty: none), gives the tensors whose values are already at
/// an offset of the existing data file whose pair id is `pair_id`.
///
/// # Errors
/// [`crate::ErrorKind::InvalidState`] when the inline values exceed what ONNX Runtime reads.
pub fn plan<'a>(
    ckpt: &Checkpoint<Payload<'a>>,
    placement: Placement,
    pair_id: &PairId,
    shared: &[Option<u64>],
) -> Result<Plan<'a>> {
    let sharing = shared.iter().any(Option::is_some);
    let writes_external = placement == Placement::External && !sharing;
    let has_external_data = (writes_external || sharing) && !ckpt.is_nominal;
    let values = |d: &Payload<'a>| match *d {
        Payload::Bytes(bytes) if !ckpt.is_nominal => Some(bytes),
        _ => None,
    };

    // External values first: the data file holds them in tensor order.
    let mut slots = Vec::new();
    let mut external = Vec::new();
    let mut external_len = 0u64;
    let mut inline_len = 0u64;
    for (i, t) in ckpt.tensors().enumerate() {
        let mut slot = Slot::Nothing;
        if let Some(bytes) = values(&t.data) {
            if let Some(offset) = shared.get(i).copied().flatten() {
                slot = Slot::External(offset);
            } else if has_external_data && writes_external && bytes.len() >= EXTERNAL_MIN_BYTES {
                let offset = external_len.next_multiple_of(PAYLOAD_ALIGNMENT as u64);
                slot = Slot::External(offset);
                external.push((offset, bytes));
                external_len = offset + bytes.len() as u64;
            } else {
                inline_len += bytes.len() as u64;
            }
        }
        slots.push(slot);
    }
    if inline_len > MAX_INLINE_LEN {
        return Err(too_large(inline_len));
    }

    // Then the inline region, in tensor order, with room for each length prefix.
    let mut inline = Vec::new();
    let mut gaps = Vec::new();
    let mut gap_ends = Vec::new();
    let mut values_end = 0usize;
    for (slot, t) in slots.iter_mut().zip(ckpt.tensors()) {
        let Some(bytes) = values(&t.data) else {
            continue;
        };
        if *slot != Slot::Nothing || bytes.is_empty() {
            continue;
        }
        let start = (values_end + 4).next_multiple_of(PAYLOAD_ALIGNMENT);
        gaps.resize(gaps.len() + (start - 4 - values_end), 0);
        // Fits: inline values total under 2^31 bytes (checked above).
        gaps.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        gap_ends.push(gaps.len());
        *slot = Slot::Inline(start);
        inline.push((start, bytes));
        values_end = start + bytes.len();
    }
    let trailer = pairing::trailer(pair_id);
    let pair_trailer = has_external_data.then_some(trailer);
    let end = checksums::block_len(slots.len()) + PAIR_TRAILER_LEN;
    let region_len = (values_end + end).next_multiple_of(PAYLOAD_ALIGNMENT);
    let mut region_tail = vec![0u8; region_len - values_end];
    let block_at = region_tail.len() - end;
    region_tail[region_len - values_end - PAIR_TRAILER_LEN..].copy_from_slice(&trailer);
    Ok(Plan {
        slots,
        inline,
        region_len,
        gaps,
        gap_ends,
        region_tail,
        block_at,
        external,
        external_len,
        has_external_data,
        pair_trailer,
    })
}

pub(crate) fn too_large(len: u64) -> Error {
    Error::invalid_state(format!(
        "the checkpoint would hold {len} bytes of values inline, beyond the {MAX_INLINE_LEN} bytes an \
         ONNX Runtime flatbuffer can hold; save with external data (a lower external_data_threshold)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{DataType, Tensor};

    fn tensor(name: &str, bytes: &'static [u8]) -> Tensor<Payload<'static>> {
        Tensor {
            name: name.to_owned(),
            dims: vec![bytes.len() as i64],
            data_type: DataType::Uint8,
            data: Payload::Bytes(bytes),
        }
    }

    fn checkpoint(sizes: &[usize]) -> Checkpoint<Payload<'static>> {
        let mut ckpt = Checkpoint::default();
        for (i, &n) in sizes.iter().enumerate() {
            let bytes: &'static [u8] = Box::leak(vec![i as u8 + 1; n].into_boxed_slice());
            ckpt.trainable.push(tensor(&format!("t{i}"), bytes));
        }
        ckpt
    }

    #[test]
    fn inline_values_are_aligned_vectors_in_tensor_order() {
        let ckpt = checkpoint(&[3, 0, 70]);
        let p = plan(&ckpt, Placement::Inline, &[0; 16], &[]).unwrap();
        assert_eq!(
            p.slots,
            vec![Slot::Inline(64), Slot::Nothing, Slot::Inline(128)]
        );
        // Then the checksum block (3 sums, the metadata's, a 32-byte footer) and the trailer.
        let end = 128 + 70 + 8 * 4 + 32 + PAIR_TRAILER_LEN;
        assert_eq!(p.region_len, end.next_multiple_of(PAYLOAD_ALIGNMENT));
        let block_and_trailer = checksums::block_len(3) + PAIR_TRAILER_LEN;
        assert_eq!(p.block_at + block_and_trailer, p.region_tail.len());
        assert!(p.region_tail.ends_with(&pairing::trailer(&[0; 16])));
        assert!(p.pair_trailer.is_none() && p.external.is_empty());
        // Each gap is zero padding, then the value's length, ending where the value starts.
        assert_eq!(p.gap_ends, vec![64, 128 - 3]);
        assert_eq!(&p.gaps[60..64], &3u32.to_le_bytes());
        assert_eq!(&p.gaps[121..125], &70u32.to_le_bytes());
        assert!(p.gaps[..60].iter().chain(&p.gaps[64..121]).all(|&b| b == 0));
    }

    #[test]
    fn external_values_leave_small_ones_inline_and_end_with_the_trailer() {
        let ckpt = checkpoint(&[100, 10, 64]);
        let p = plan(&ckpt, Placement::External, &[7; 16], &[]).unwrap();
        assert_eq!(
            p.slots,
            vec![Slot::External(0), Slot::Inline(64), Slot::External(128)]
        );
        assert_eq!(p.external_len, 128 + 64);
        let trailer = pairing::trailer(&[7; 16]);
        assert_eq!(p.region_len % PAYLOAD_ALIGNMENT, 0);
        assert!(p.region_tail.ends_with(&trailer) && p.has_external_data);
    }

    #[test]
    fn shared_values_point_into_the_existing_data_file_and_the_rest_stay_inline() {
        let ckpt = checkpoint(&[100, 200, 70]);
        let p = plan(
            &ckpt,
            Placement::External,
            &[9; 16],
            &[Some(4096), None, Some(0)],
        )
        .unwrap();
        assert_eq!(
            p.slots,
            vec![Slot::External(4096), Slot::Inline(64), Slot::External(0)]
        );
        // Nothing for the data file (it exists already), which the trailer names.
        assert!(p.external.is_empty() && p.external_len == 0 && p.has_external_data);
        assert!(p.region_tail.ends_with(&pairing::trailer(&[9; 16])));
    }

    #[test]
    fn a_nominal_checkpoint_places_nothing() {
        let mut ckpt = checkpoint(&[100, 10]);
        ckpt.is_nominal = true;
        let p = plan(&ckpt, Placement::External, &[0; 16], &[]).unwrap();
        assert_eq!(p.slots, vec![Slot::Nothing, Slot::Nothing]);
        assert!(p.inline.is_empty() && p.external.is_empty() && !p.has_external_data);
    }
}
