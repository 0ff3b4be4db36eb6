//! Writing a checkpoint: encoded, written into temporary files with its values summed as they
//! go, sealed, then committed in place of what was there; or encoded for a stream or memory.

use std::path::Path;

use crate::error::{Error, Result};
use crate::format::{self, Checkpoint, Payload, Placement};
use crate::io::{self, both_ends, both_ends::Placed};
use crate::seal::{checksums, external_data_path};

/// ONNX Runtime's default: above this many bytes of values, a checkpoint uses external data.
pub const DEFAULT_EXTERNAL_DATA_THRESHOLD: u64 = 1800 << 20;

/// Options for [`save`].
#[derive(Clone, Debug)]
pub struct SaveOptions {
    /// fsync the files and their directory before returning (survives power loss, costs time).
    pub durable: bool,
    /// Values totalling more than this go to `<path>.data` (0: always, when there are any).
    pub external_data_threshold: u64,
    /// Threads writing the external data file.
    pub threads: usize,
    /// Counts the bytes written, for another thread to poll (a progress bar).
    pub progress: Option<std::sync::Arc<io::Progress>>,
    /// Write tensors in the order given, as ONNX Runtime's TensorProto path does,
    /// instead of sorted by name as its state path does.
    pub keep_order: bool,
    /// How long the commit waits for another save of the same path to finish its renames.
    pub lock_timeout: std::time::Duration,
    /// For [`write_staged`]: values (by the address of their first byte) left unwritten, as
    /// holes that read back as zeros, for the caller to fill in place before the commit:
    /// their bytes then go out once, not zeros first.
    pub holes: std::collections::HashSet<usize>,
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions {
            durable: false,
            external_data_threshold: DEFAULT_EXTERNAL_DATA_THRESHOLD,
            threads: std::thread::available_parallelism().map_or(2, |n| n.get().min(4)),
            progress: None,
            keep_order: false,
            lock_timeout: io::locks::DEFAULT_LOCK_TIMEOUT,
            holes: std::collections::HashSet::new(),
        }
    }
}

/// Encodes `ckpt` for writing as a stream, not to a path: placed as [`save`] places it
/// (external data above `external_data_threshold` bytes of values), sorted like it unless
/// `keep_order`. [`format::Encoded::segments`] are the checkpoint file in order and
/// [`format::Encoded::external_data`] its data file; both borrow the tensor bytes. Its
/// checksum block is left to seal ([`format::Encoded::seal`] as the values are written, or
/// [`format::Encoded::seal_from_memory`]).
///
/// # Errors
/// As [`save`], less the OS errors.
pub fn encode_for_stream<'a>(
    ckpt: &Checkpoint<Payload<'a>>,
    keep_order: bool,
    external_data_threshold: u64,
) -> Result<format::Encoded<'a>> {
    format::endian::ensure_host_little_endian()?;
    let sorted;
    let ckpt = if keep_order {
        ckpt
    } else {
        sorted = ckpt.sorted_like_ort_state_path();
        &sorted
    };
    let placement = if values_len(ckpt) > external_data_threshold {
        Placement::External
    } else {
        Placement::Inline
    };
    format::encode(ckpt, placement)
}

/// Encodes `ckpt` as one buffer in memory (sorted like [`save`] unless `keep_order`;
/// never external data, so at most 2 GiB). The result borrows the tensor bytes: its
/// [`format::Encoded::segments`] concatenated are the file [`save`] would write.
///
/// # Errors
/// As [`save`], less the OS errors.
pub fn encode_in_memory<'a>(
    ckpt: &Checkpoint<Payload<'a>>,
    keep_order: bool,
) -> Result<format::Encoded<'a>> {
    let values = values_len(ckpt);
    if values > format::encode::MAX_INLINE_LEN {
        return Err(Error::invalid_state(format!(
            "the checkpoint holds {values} bytes of values; one buffer holds at most {} (in memory \
             there is no external data file): save larger checkpoints to a path",
            format::encode::MAX_INLINE_LEN
        )));
    }
    let mut encoded = encode_for_stream(ckpt, keep_order, u64::MAX)?; // never past the threshold: inline
    encoded.seal_from_memory();
    Ok(encoded)
}

/// Writes the checkpoint file's body (`segments`, back to back from the start; `value_of` says
/// which inline value each one is, if any; `holes`: values left unwritten, as in
/// [`SaveOptions::holes`]) and returns the inline values' checksums, taken as
/// they are written. Leaves the file's position at the body's end, for the block after it.
pub(crate) fn write_body(
    file: &mut std::fs::File,
    segments: &[&[u8]],
    value_of: &[Option<usize>],
    holes: &std::collections::HashSet<usize>,
    threads: usize,
    after: &io::AfterEachPiece<'_>,
) -> std::io::Result<Vec<checksums::Sum>> {
    let values = value_of.iter().flatten().count();
    let len: usize = segments.iter().map(|s| s.len()).sum();
    if holes.is_empty() && both_ends::pays_for(file, len as u64, threads) {
        let mut at = 0;
        let placed: Vec<Placed> = segments
            .iter()
            .zip(value_of)
            .map(|(bytes, value)| {
                let offset = at;
                at += bytes.len() as u64;
                Placed {
                    offset,
                    bytes,
                    summed: value.is_some(),
                }
            })
            .collect();
        let sums = both_ends::write_from_both_ends(file, len as u64, &placed, after)?;
        let mut inline_sums = vec![0; values];
        for (sum, value) in sums.into_iter().zip(value_of) {
            if let Some(i) = value {
                inline_sums[*i] = sum;
            }
        }
        std::io::Seek::seek(file, std::io::SeekFrom::Start(len as u64))?;
        return Ok(inline_sums);
    }
    let hole = |bytes: &[u8]| holes.contains(&(bytes.as_ptr() as usize));
    let mut inline_sums = vec![checksums::Running::default(); values];
    let mut sum_values = |segment: usize, piece: &[u8]| {
        if let Some(i) = value_of[segment] {
            inline_sums[i].update(piece);
        }
    };
    io::write_segments(file, segments, &hole, &mut sum_values, after)?;
    Ok(inline_sums.iter().map(|s| s.finish()).collect())
}

/// Bytes of tensor values in `ckpt` (strings not counted).
fn values_len(ckpt: &Checkpoint<Payload<'_>>) -> u64 {
    ckpt.tensors()
        .map(|t| match t.data {
            Payload::Bytes(b) => b.len() as u64,
            _ => 0,
        })
        .sum()
}

/// Writes `ckpt` to `path` the way ONNX Runtime's state-path saver does (sorted
/// by name unless `options.keep_order`), replacing any previous file atomically.
/// Above `options.external_data_threshold` bytes of values, they go to `<path>.data`.
///
/// # Errors
/// Invalid states (bytes that disagree with dims, duplicate names) and OS errors,
/// naming the file and tensor; the previous file at `path` is left intact.
pub fn save(path: &Path, ckpt: &Checkpoint<Payload<'_>>, options: &SaveOptions) -> Result<()> {
    write_staged(path, ckpt, options)?
        .0
        .commit(&io::CommitOptions {
            durable: options.durable,
            lock_timeout: options.lock_timeout,
            unpaired: false,
        })
}

/// Where each tensor's values went in a staged save: (offset, in the data file?), by the
/// address of the caller's bytes (the tensors' own buffers, which the caller knows).
pub type PlacedValues = Vec<(usize, u64, bool)>;

/// [`save`] up to, not including, the commit: the files written in full into temporary
/// files (not fsynced), and where each tensor's values are in them, so that a caller may
/// fill values in place before [`io::Staged::commit`] publishes them.
///
/// # Errors
/// As [`save`].
pub fn write_staged(
    path: &Path,
    ckpt: &Checkpoint<Payload<'_>>,
    options: &SaveOptions,
) -> Result<(io::Staged, PlacedValues)> {
    // Sorted in a copy (names, dims and string values are cloned, tensor bytes never): the
    // caller's order stays. Callers that built the checkpoint for this save can sort it in place
    // and set keep_order, as the Python layer does.
    let mut encoded = encode_for_stream(ckpt, options.keep_order, options.external_data_threshold)
        .map_err(|e| e.in_file(path))?;
    let external = encoded.has_external_data().then(|| encoded.external_data());
    let unobserved = io::Progress::default();
    let progress = options.progress.as_deref().unwrap_or(&unobserved);
    let main_len = encoded.len();
    let values_len: usize = external
        .iter()
        .flat_map(|(_, parts)| parts.iter().map(|(_, bytes)| bytes.len()))
        .sum();
    progress.begin((main_len + values_len) as u64);
    let after = io::AfterEachPiece {
        writeback: options.durable,
        progress,
    };
    let mut staged = io::Staged::new(path, external.is_some())?;
    // Every value is summed as it is written (no second pass over it); the block holding the
    // sums is written last, after the values of both files. Holes are left unwritten: their
    // sums are taken when the caller, having filled them, reseals (`integrity::reseal`).
    let hole = |bytes: &[u8]| options.holes.contains(&(bytes.as_ptr() as usize));
    let mut external_sums = Vec::new();
    if let (Some((len, values)), Some(data)) = (&external, staged.data()) {
        let written: Vec<(u64, &[u8])> = values.iter().copied().filter(|(_, b)| !hole(b)).collect();
        progress.add(values_len as u64 - written.iter().map(|(_, b)| b.len() as u64).sum::<u64>());
        let mut sums = io::write_at_parallel(data.file(), *len, &written, options.threads, &after)
            .map_err(|e| Error::from(e).in_file(&external_data_path(path)))?
            .into_iter();
        external_sums = values
            .iter()
            .map(|(_, b)| if hole(b) { 0 } else { sums.next().unwrap_or(0) })
            .collect();
        external_sums.pop(); // the pair trailer's
    }
    let in_main = |e: std::io::Error| Error::from(e).in_file(path);
    let (body, value_of): (Vec<&[u8]>, Vec<Option<usize>>) = encoded.body().into_iter().unzip();
    let inline_sums = write_body(
        staged.main().file(),
        &body,
        &value_of,
        &options.holes,
        options.threads,
        &after,
    )
    .map_err(in_main)?;
    encoded.seal(&inline_sums, &external_sums);
    io::write_segments(
        staged.main().file(),
        &encoded.tail(),
        &|_| false,
        &mut |_, _| {},
        &after,
    )
    .map_err(in_main)?;
    let external = encoded.has_external_data().then(|| encoded.external_data());
    let mut placed: PlacedValues = encoded
        .payload_ranges()
        .zip(encoded.payload_addresses())
        .map(|((offset, _), address)| (address, offset as u64, false))
        .collect();
    if let Some((_, values)) = &external {
        placed.extend(
            values
                .iter()
                .map(|(offset, bytes)| (bytes.as_ptr() as usize, *offset, true)),
        );
    }
    Ok((staged, placed))
}
