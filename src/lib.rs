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
//! Layout: [`format`] turns bytes into a [`format::Checkpoint`] and back without
//! touching the filesystem; [`io`] maps and atomically writes files; the
//! `python` feature adds the PyO3 extension module.

pub mod compute;
pub mod error;
pub mod format;
#[allow(clippy::all, unused_imports, dead_code, non_camel_case_types, unsafe_op_in_unsafe_fn)]
#[rustfmt::skip]
pub mod generated;
mod integrity;
pub mod io;
#[cfg(feature = "python")]
mod python;
mod random;
pub mod sharing;

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use memmap2::MmapMut;

pub use error::{Error, ErrorKind, Result};
use format::{pairing, Checkpoint, Payload, Placement, Stored, Tensor};
pub use integrity::{checksum_root_of_file, reseal, seal_written, Checked, Filled};

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

/// The external data file of a checkpoint: `<path>.data`, as ONNX Runtime names it.
pub fn external_data_path(path: &Path) -> PathBuf {
    let mut name = OsString::from(path.as_os_str());
    name.push(".data");
    PathBuf::from(name)
}

/// A checkpoint opened by [`load`]: the decoded metadata and the private mappings
/// its tensor bytes live in.
pub struct LoadedCheckpoint {
    path: PathBuf,
    map: MmapMut,
    /// The external data file's mapping (None when there is none, or it is empty).
    data: Option<MmapMut>,
    checkpoint: Checkpoint<Stored>,
    /// The files mapped (checkpoint, external data), open for as long as this lives: what
    /// [`LoadedCheckpoint::verify_checksums`] reads (see [`io::map_private`]).
    files: (std::fs::File, Option<std::fs::File>),
}

impl std::fmt::Debug for LoadedCheckpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedCheckpoint")
            .field("path", &self.path)
            .field("len", &self.map.len())
            .field("data_len", &self.data.as_ref().map_or(0, |d| d.len()))
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
        let outside = || Error::malformed("tensor bytes lie outside the file");
        match tensor.data {
            Stored::Inline { offset, len } => {
                self.map.get(offset..offset + len).ok_or_else(outside)
            }
            Stored::External { offset, len } => {
                let data: &[u8] = self.data.as_deref().unwrap_or_default();
                // In range: load() checked every external range against the file's size.
                data.get(offset as usize..(offset + len) as usize)
                    .ok_or_else(outside)
            }
            Stored::Strings(_) | Stored::Absent => Err(Error::invalid_state(
                "tensor has no bytes (strings or nominal values)",
            )),
        }
        .map_err(|e| e.in_tensor(&tensor.name).in_file(&self.path))
    }

    /// The checkpoint with every tensor's values borrowed from the mappings,
    /// ready to be saved elsewhere.
    pub fn as_payloads(&self) -> Result<Checkpoint<Payload<'_>>> {
        self.checkpoint.try_map_data(|t| match &t.data {
            Stored::Strings(s) => Ok(Payload::Strings(s.clone())),
            Stored::Absent => Ok(Payload::Absent),
            _ => self.bytes(t).map(Payload::Bytes),
        })
    }

    /// The mappings (checkpoint, external data) and the metadata, for callers
    /// (the Python layer) that hand out views.
    #[cfg(feature = "python")]
    pub(crate) fn into_parts(self) -> (MmapMut, Option<MmapMut>, Checkpoint<Stored>) {
        (self.map, self.data, self.checkpoint)
    }
}

/// Maps and verifies the checkpoint at `path` (and `<path>.data` when it has
/// external data); tensor bytes are not read until used.
///
/// A checkpoint with external data is two files, and another process may replace
/// both while this one opens them. Should the pair not match, and either file have
/// been replaced since it was opened, the load starts over (a bounded number of
/// times): a reader gets one save's checkpoint whole, never a mix of two.
///
/// # Errors
/// OS errors (missing file or data file, a directory, anything but a regular file),
/// malformed files, external ranges beyond the data file, unsupported data types:
/// each naming the file and, where there is one, the tensor.
pub fn load(path: &Path) -> Result<LoadedCheckpoint> {
    load_with(path, true)
}

/// [`load`], optionally refusing a symlink at `path` or at its data file (ELOOP): for
/// checkpoints named by a document (a sharded index, a manager's step directory), which
/// must stay inside their directory.
///
/// # Errors
/// As [`load`].
pub fn load_with(path: &Path, follow_symlinks: bool) -> Result<LoadedCheckpoint> {
    format::endian::ensure_host_little_endian()?;
    const ATTEMPTS: u32 = 64;
    let mut attempt = 0;
    loop {
        match load_once(path, follow_symlinks) {
            Ok(loaded) => return Ok(loaded),
            Err(Attempt::Raced(_)) if attempt < ATTEMPTS => {
                attempt += 1;
                // The saves racing us commit by two renames: usually retrying at once is
                // enough; back off in case a writer is starved of CPU mid-commit.
                std::thread::sleep(std::time::Duration::from_micros(
                    (50u64 << attempt.min(9)).min(20_000),
                ));
            }
            Err(Attempt::Raced(e) | Attempt::Failed(e)) => return Err(e),
        }
    }
}

/// Why one attempt at [`load`] failed: for good, or because a save replaced a file
/// while it was being opened.
enum Attempt {
    Failed(Error),
    Raced(Error),
}

impl From<Error> for Attempt {
    fn from(e: Error) -> Self {
        Attempt::Failed(e)
    }
}

fn load_once(path: &Path, follow_symlinks: bool) -> std::result::Result<LoadedCheckpoint, Attempt> {
    let (mut map, main_id, mut main_file) = map_checkpoint(path, follow_symlinks)?;
    let mut checkpoint = format::decode(&map).map_err(|e| e.in_file(path))?;
    let (mut data, mut data_file) = (None, None);
    if checkpoint.has_external_data {
        let data_path = external_data_path(path);
        // Replaced since we opened them? Then whatever went wrong may be a save's doing.
        let raced = |data_id: Option<io::FileId>, e: Error| {
            let moved = io::FileId::of_path(path) != Some(main_id)
                || data_id.is_some_and(|id| io::FileId::of_path(&data_path) != Some(id));
            if moved {
                Attempt::Raced(e)
            } else {
                Attempt::Failed(e)
            }
        };
        let main_pair = pairing::pair_id(&map);
        let (mapped, data_id, file) = match io::map_private_any(&data_path, follow_symlinks) {
            Ok(found) => found,
            // A save moves the previous data file out of sight before it renames its own into
            // place: killed between the two, it leaves the checkpoint's data file hidden.
            Err(e) if matches!(e.kind(), ErrorKind::Io(io) if io.kind() == std::io::ErrorKind::NotFound) => {
                match main_pair.and_then(|id| data_of_interrupted_save(path, id)) {
                    Some(found) => found,
                    None => return Err(raced(None, e)),
                }
            }
            Err(e) => return Err(raced(None, e)),
        };
        (data, data_file) = (mapped, Some(file));
        let pair = data.as_deref().and_then(pairing::pair_id);
        if let (Some(main_pair), Some(data_pair)) = (main_pair, pair) {
            if main_pair != data_pair {
                match checkpoint_of_interrupted_save(path, data_pair) {
                    Ok(found) => (map, checkpoint, main_file) = found,
                    // Or the previous data file, moved out of sight by a save that failed or was
                    // killed before its data file replaced it: the checkpoint in place is whole.
                    Err(e) => match data_of_interrupted_save(path, main_pair) {
                        Some((found, _, file)) => (data, data_file) = (found, Some(file)),
                        None => return Err(raced(Some(data_id), e)),
                    },
                }
            }
        }
        let len = data.as_ref().map_or(0, |d| d.len() as u64);
        check_external_ranges(&checkpoint, len)
            .map_err(|e| raced(Some(data_id), e.in_file(&data_path)))?;
    }
    Ok(LoadedCheckpoint {
        path: path.to_path_buf(),
        map,
        data,
        checkpoint,
        files: (main_file, data_file),
    })
}

fn map_checkpoint(
    path: &Path,
    follow_symlinks: bool,
) -> Result<(MmapMut, io::FileId, std::fs::File)> {
    io::map_private(path, follow_symlinks, 8, |len| {
        Error::malformed(format!(
            "file is too short to be a checkpoint ({len} bytes)"
        ))
    })
}

/// `path` and its data file come from different saves: a save stopped (or is
/// about to go on) between renaming its data file into place and renaming its
/// checkpoint (see [`format::pairing`]). That save's checkpoint is complete in its
/// temporary file, so it is the one loaded (nothing is renamed or deleted here; the
/// next save cleans up).
fn checkpoint_of_interrupted_save(
    path: &Path,
    data_id: pairing::PairId,
) -> Result<(MmapMut, Checkpoint<Stored>, std::fs::File)> {
    for temp in io::pending_temps(path) {
        let Ok((map, _, file)) = map_checkpoint(&temp, false) else {
            continue;
        };
        if pairing::pair_id(&map) == Some(data_id) {
            let checkpoint = format::decode(&map).map_err(|e| e.in_file(&temp))?;
            return Ok((map, checkpoint, file));
        }
    }
    Err(Error::malformed(format!(
        "the checkpoint and its data file {} come from different saves (a save was \
         interrupted), and the checkpoint matching the data file is gone",
        external_data_path(path).display()
    ))
    .in_file(path))
}

/// The data file of the checkpoint at `path` whose pair id is `id`, moved out of sight (a
/// temporary name of `<path>.data`'s) by a save that was interrupted before it renamed its own
/// data file into place or back: its mapping, if there is one.
fn data_of_interrupted_save(
    path: &Path,
    id: pairing::PairId,
) -> Option<(Option<MmapMut>, io::FileId, std::fs::File)> {
    io::pending_temps(&external_data_path(path))
        .into_iter()
        .filter_map(|temp| io::map_private_any(&temp, false).ok())
        .find(|(map, _, _)| map.as_deref().and_then(pairing::pair_id) == Some(id))
}

/// Every external tensor must lie inside the data file, before any view exists.
fn check_external_ranges(ckpt: &Checkpoint<Stored>, data_len: u64) -> Result<()> {
    for (i, t) in ckpt.tensors_named_lazily().enumerate() {
        if let Stored::External { offset, len } = t.data {
            if offset.checked_add(len).is_none_or(|end| end > data_len) {
                let name = ckpt.tensors_named().nth(i).map(|(n, _)| n);
                return Err(Error::malformed(format!(
                    "external data at offset {offset}, {len} bytes long, lies beyond the end of the \
                     data file ({data_len} bytes)"
                ))
                .in_tensor(&name.unwrap_or_default()));
            }
        }
    }
    Ok(())
}

/// Decodes a checkpoint held in memory (ONNX Runtime's `LoadCheckpointFromBuffer`): the
/// result holds byte ranges of `buf`, copies nothing, and reads no other file.
///
/// # Errors
/// Malformed bytes as [`load`] reports them, and a checkpoint whose values are in an
/// external data file, which one buffer cannot hold.
pub fn decode_buffer(buf: &[u8]) -> Result<Checkpoint<Stored>> {
    decode_buffer_paired(buf, None)
}

/// [`decode_buffer`] for a checkpoint whose external data file is held elsewhere (an
/// object store): `data` is that file's length and its last bytes (at least the pair
/// trailer's 32, or all of a shorter file), which is all the checks need. The data file
/// must be the one saved with the checkpoint, and hold every external range.
///
/// # Errors
/// As [`decode_buffer`]; with external data and no `data`, or a data file from another
/// save, or one too short for a tensor.
pub fn decode_buffer_paired(buf: &[u8], data: Option<(u64, &[u8])>) -> Result<Checkpoint<Stored>> {
    format::endian::ensure_host_little_endian()?;
    let checkpoint = format::decode(buf)?;
    if !checkpoint.has_external_data {
        return Ok(checkpoint);
    }
    let Some((data_len, data_tail)) = data else {
        return Err(Error::invalid_state(
            "the checkpoint keeps its values in an external data file (<checkpoint>.data), \
             which has no place in a single buffer: load it from its path",
        ));
    };
    if let (Some(main_pair), Some(data_pair)) = (pairing::pair_id(buf), pairing::pair_id(data_tail))
    {
        if main_pair != data_pair {
            return Err(Error::malformed(
                "the checkpoint and its data file come from different saves (a save of both \
                 was interrupted, or one was replaced)",
            ));
        }
    }
    check_external_ranges(&checkpoint, data_len)?;
    Ok(checkpoint)
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
    let mut inline_sums =
        vec![format::checksums::Running::default(); encoded.payload_ranges().count()];
    let mut sum_values = |segment: usize, piece: &[u8]| {
        if let Some(i) = value_of[segment] {
            inline_sums[i].update(piece);
        }
    };
    io::write_segments(staged.main().file(), &body, &hole, &mut sum_values, &after)
        .map_err(in_main)?;
    let inline_sums: Vec<_> = inline_sums.iter().map(|s| s.finish()).collect();
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
