//! Opening a checkpoint: its file (and `<path>.data`) mapped privately, the pair checked, the
//! metadata decoded; or a checkpoint decoded from memory.

use std::path::{Path, PathBuf};

use memmap2::MmapMut;

use crate::error::{Error, ErrorKind, Result};
use crate::format::{self, Checkpoint, Payload, Stored, Tensor};
use crate::io;
use crate::seal::{external_data_path, pairing};

/// A checkpoint opened by [`load`]: the decoded metadata and the private mappings
/// its tensor bytes live in.
pub struct LoadedCheckpoint {
    pub(crate) path: PathBuf,
    pub(crate) map: MmapMut,
    /// The external data file's mapping (None when there is none, or it is empty).
    pub(crate) data: Option<MmapMut>,
    pub(crate) checkpoint: Checkpoint<Stored>,
    /// The files mapped (checkpoint, external data), open for as long as this lives: what
    /// [`LoadedCheckpoint::verify_checksums`] reads (see [`io::map_private`]).
    pub(crate) files: (std::fs::File, Option<std::fs::File>),
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
/// checkpoint (see [`pairing`]). That save's checkpoint is complete in its
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
