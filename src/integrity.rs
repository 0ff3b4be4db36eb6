//! Checking a checkpoint against the checksum block it carries ([`crate::seal::checksums`]).
//!
//! The check reads every value once, through the files [`crate::load`] mapped, with read(2)
//! into one small buffer the sums stay in cache with, not through the mappings: another
//! process truncating a file under a check must make it fail, not fault a read of a page
//! past the new end (SIGBUS, which ends the process). Nothing is kept: the memory used is
//! one buffer, whatever the file's size. Files without a block (ONNX Runtime's, an older
//! ortckpt's) are reported as such; their check is decoding.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;

use memmap2::{MmapMut, UncheckedAdvice};
use std::path::Path;

use crate::error::{Error, Result};
use crate::format::encode::PAYLOAD_ALIGNMENT;
use crate::format::{Checkpoint, Stored};
use crate::io;
use crate::load::LoadedCheckpoint;
use crate::seal::checksums::{self, Block, Running, Sum};
use crate::seal::external_data_path;
use crate::seal::pairing::{self, PAIR_MAGIC};

/// What [`LoadedCheckpoint::verify_checksums`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Checked {
    /// The file carries no checksums (ONNX Runtime wrote it, or an ortckpt before them).
    NoChecksums,
    /// Every tensor and the metadata match; `root` is the block's own checksum.
    Verified {
        tensors: usize,
        bytes: u64,
        root: Sum,
    },
}

impl LoadedCheckpoint {
    /// Sums every tensor's bytes and the metadata around them and compares them with the
    /// file's checksum block.
    ///
    /// # Errors
    /// [`crate::ErrorKind::Integrity`] naming the file and, for a tensor's bytes, the tensor.
    pub fn verify_checksums(&self) -> Result<Checked> {
        let in_file = |e: Error| e.in_file(&self.path);
        let main = Reader::new(&self.files.0, self.map.len(), &self.path);
        let tensors = self.checkpoint.tensors().count();
        let Some(footer) = footer_of(&main)? else {
            // (A tail the decoded tensors bound: the file's bytes are no longer mapped.)
            let tail = main.tail(checksums::tail_len(tensors) + PAYLOAD_ALIGNMENT)?;
            return match truncated_block(&tail, tensors) {
                true => Err(in_file(Error::integrity(
                    "the file ends inside its checksum block or trailer: it is truncated",
                ))),
                false => Ok(Checked::NoChecksums),
            };
        };
        // The block is read only once its count is the checkpoint's: a damaged or hostile
        // count never sizes what is read.
        if footer.count != tensors {
            return Err(in_file(Error::integrity(format!(
                "the checkpoint lists {tensors} tensors, its checksum block {}",
                footer.count
            ))));
        }
        let start = footer.start as usize;
        let body = main.bytes(start, start + footer.body_len())?;
        let block = footer
            .check(&body)
            .map_err(|why| in_file(Error::integrity(why)))?
            .expect("a checked block");
        let data_path = external_data_path(&self.path);
        let data = self.files.1.as_ref().zip(self.data.as_ref());
        let data = data.map(|(file, map)| Reader::new(file, map.len(), &data_path));
        let mut bytes = 0;
        let sums = tensor_sums(&main, data.as_ref(), &self.checkpoint, &block, |_, _| None)
            .map_err(in_file)?;
        for ((name, t), (found, expected)) in self
            .checkpoint
            .tensors_named()
            .zip(sums.iter().zip(&block.tensors))
        {
            if found != expected {
                let file = match t.data {
                    Stored::External { .. } => external_data_path(&self.path),
                    _ => self.path.clone(),
                };
                return Err(Error::integrity(format!(
                    "the tensor's bytes differ from their checksum ({found:016x}, the file \
                     recorded {expected:016x})"
                ))
                .in_tensor(&name)
                .in_file(&file));
            }
            bytes += match t.data {
                Stored::Inline { len, .. } => len as u64,
                Stored::External { len, .. } => len,
                _ => 0,
            };
        }
        let metadata = metadata_sum(&main, &self.checkpoint, &block).map_err(in_file)?;
        if metadata != block.metadata {
            return Err(in_file(Error::integrity(
                "the checkpoint's metadata (names, shapes, strings, properties, layout) differs \
                 from its checksum",
            )));
        }
        Ok(Checked::Verified {
            tensors: sums.len(),
            bytes,
            root: block.root,
        })
    }
}

/// Whether a file without a block at its end (nor a whole pair trailer: an older ortckpt's
/// file) still holds the start of a block or trailer in the last bytes they would take: an
/// ortckpt file cut short. (Cut deeper, into the values, it no longer decodes; cut inside a
/// long block's sums, past its magic, it is not caught here: the manager records every
/// file's size.)
fn truncated_block(map: &[u8], tensors: usize) -> bool {
    if pairing::pair_id(map).is_some() {
        return false;
    }
    let tail = &map[map
        .len()
        .saturating_sub(checksums::tail_len(tensors) + PAYLOAD_ALIGNMENT)..];
    let prefix = 8;
    [&checksums::BLOCK_MAGIC[..prefix], &PAIR_MAGIC[..prefix]]
        .iter()
        .any(|magic| tail.windows(prefix).any(|w| w == *magic))
}

/// Where a check reads the bytes it sums: a file as it was mapped ([`Reader`]), or a mapping
/// nobody else writes (a staged file [`reseal`] sums).
trait Source {
    /// Bytes in the file when it was opened.
    fn len(&self) -> usize;
    /// Feeds `self[start..end]` (inside `len`) to `running`.
    fn feed(&self, start: usize, end: usize, running: &mut Running) -> Result<()>;

    fn sum(&self, start: usize, end: usize) -> Result<Sum> {
        let mut running = Running::default();
        self.feed(start, end, &mut running)?;
        Ok(running.finish())
    }
}

impl Source for MmapMut {
    fn len(&self) -> usize {
        self.as_ref().len()
    }

    fn feed(&self, start: usize, end: usize, running: &mut Running) -> Result<()> {
        feed_dropping(self, start, end, running);
        Ok(())
    }
}

/// Reads an open file at offsets, through a window of [`WINDOW`] bytes: the small ranges of
/// a checkpoint of many tensors (its values, the metadata between them) cost one read per
/// window, not one each.
struct Reader<'a> {
    file: &'a File,
    len: usize,
    path: &'a Path,
    /// (offset of the bytes in the buffer, the buffer).
    window: RefCell<(usize, Vec<u8>)>,
}

/// Bytes read at once: summed while they are still in the CPU's cache.
const WINDOW: usize = 1 << 20;

impl<'a> Reader<'a> {
    fn new(file: &'a File, len: usize, path: &'a Path) -> Self {
        Reader {
            file,
            len,
            path,
            window: RefCell::new((0, Vec::new())),
        }
    }
}

impl Reader<'_> {
    /// `self[start..end]`, copied (for small ranges: a block, a tail).
    fn bytes(&self, start: usize, end: usize) -> Result<Vec<u8>> {
        if end > self.len || start > end {
            return Err(
                Error::integrity("a range lies beyond the end of the file").in_file(self.path)
            );
        }
        let mut out = vec![0u8; end - start];
        self.file
            .read_exact_at(&mut out, start as u64)
            .map_err(|e| self.read_failed(e))?;
        Ok(out)
    }

    /// The file's last `n` bytes (all of it, when shorter).
    fn tail(&self, n: usize) -> Result<Vec<u8>> {
        self.bytes(self.len - n.min(self.len), self.len)
    }

    fn read_failed(&self, e: std::io::Error) -> Error {
        match e.kind() {
            std::io::ErrorKind::UnexpectedEof => Error::integrity(format!(
                "the file is shorter than the {} bytes it had when it was opened: it was \
                 truncated while being checked",
                self.len
            )),
            _ => e.into(),
        }
        .in_file(self.path)
    }
}

impl Source for Reader<'_> {
    fn len(&self) -> usize {
        self.len
    }

    fn feed(&self, start: usize, end: usize, running: &mut Running) -> Result<()> {
        if end > self.len {
            return Err(
                Error::integrity("a range lies beyond the end of the file").in_file(self.path)
            );
        }
        let mut window = self.window.borrow_mut();
        let (at, buffer) = &mut *window;
        let mut from = start;
        while from < end {
            if !(*at..*at + buffer.len()).contains(&from) {
                let n = WINDOW.min(self.len - from);
                buffer.resize(n, 0);
                *at = from;
                if let Err(e) = self.file.read_exact_at(buffer, from as u64) {
                    buffer.clear();
                    return Err(self.read_failed(e));
                }
            }
            let to = end.min(*at + buffer.len());
            running.update(&buffer[from - *at..to - *at]);
            from = to;
        }
        Ok(())
    }
}

/// The footer of the file `reader` reads, if it has a block.
fn footer_of(reader: &Reader<'_>) -> Result<Option<checksums::Footer>> {
    if reader.len < checksums::FOOTER_AND_TRAILER_LEN {
        return Ok(None);
    }
    let last = reader.tail(checksums::FOOTER_AND_TRAILER_LEN)?;
    checksums::Footer::read(&last, reader.len as u64)
        .map_err(|why| Error::integrity(why).in_file(reader.path))
}

/// Bytes summed between two drops of the pages behind.
const CHUNK: usize = 8 << 20;

/// Feeds `map[start..end]` to `running`, chunk by chunk, dropping each chunk's pages once
/// summed. Only for mappings nobody wrote through (MADV_DONTNEED also drops copy-on-write
/// changes), nor truncates.
fn feed_dropping(map: &MmapMut, start: usize, end: usize, running: &mut Running) {
    if end - start <= CHUNK {
        return running.update(&map[start..end]);
    }
    let page = page_size();
    let mut at = start;
    while at < end {
        let next = (at + CHUNK).min(end);
        running.update(&map[at..next]);
        let (from, to) = (at.div_ceil(page) * page, next / page * page);
        if to > from {
            // SAFETY: the range lies inside the mapping, private and not written through:
            // later reads fault the file's bytes in again.
            let _ =
                unsafe { map.unchecked_advise_range(UncheckedAdvice::DontNeed, from, to - from) };
        }
        at = next;
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).unwrap_or(4096).max(1)
}

/// The sum of each tensor's bytes, in file order: `known(index, stored)` where it knows it,
/// else read from the file.
fn tensor_sums<S: Source>(
    map: &S,
    data: Option<&S>,
    ckpt: &Checkpoint<Stored>,
    block: &Block,
    known: impl Fn(usize, &Stored) -> Option<Sum>,
) -> Result<Vec<Sum>> {
    let count = ckpt.tensors().count();
    if count != block.tensors.len() {
        return Err(Error::integrity(format!(
            "the checkpoint lists {count} tensors, its checksum block {}",
            block.tensors.len()
        )));
    }
    let outside =
        |name: &str| Error::integrity("the tensor's bytes lie outside the file").in_tensor(name);
    ckpt.tensors_named()
        .enumerate()
        .map(|(index, (name, t))| {
            if let Some(sum) = known(index, &t.data) {
                return Ok(sum);
            }
            let (file, start, end) = match t.data {
                Stored::Inline { offset, len } => (Some(map), offset, offset.checked_add(len)),
                Stored::External { offset, len } => (
                    data,
                    usize::try_from(offset).unwrap_or(usize::MAX),
                    offset
                        .checked_add(len)
                        .and_then(|e| usize::try_from(e).ok()),
                ),
                Stored::Strings(_) | Stored::Absent => return Ok(checksums::sum(&[])),
            };
            match (file, end) {
                (Some(file), Some(end)) if start <= end && end <= file.len() => {
                    file.sum(start, end)
                }
                // An empty external tensor of an empty data file (which is not mapped).
                (None, Some(0)) if start == 0 => Ok(checksums::sum(&[])),
                _ => Err(outside(&name)),
            }
        })
        .collect()
}

/// The sum of every byte before the block but the inline values.
fn metadata_sum(map: &impl Source, ckpt: &Checkpoint<Stored>, block: &Block) -> Result<Sum> {
    let mut values: Vec<(usize, usize)> = ckpt
        .tensors()
        .filter_map(|t| match t.data {
            Stored::Inline { offset, len } if len > 0 => Some((offset, offset + len)),
            _ => None,
        })
        .collect();
    values.sort_unstable();
    let mut sum = Running::default();
    let mut at = 0;
    for (start, end) in values {
        if start < at || end > block.start {
            return Err(Error::integrity(
                "the checkpoint's values overlap or run into its checksum block",
            ));
        }
        map.feed(at, start, &mut sum)?;
        at = end;
    }
    if at > block.start || block.start > map.len() {
        return Err(Error::integrity("the checksum block lies outside the file"));
    }
    map.feed(at, block.start, &mut sum)?;
    Ok(sum.finish())
}

/// The size and root checksum of the checkpoint file at `path`, read from its block (its last
/// bytes only): what a manager records of a file it just wrote, without reading it back. The
/// root is None for a file without a block.
///
/// # Errors
/// OS errors (a symlink, without `follow_symlinks`; anything but a regular file);
/// [`crate::ErrorKind::Integrity`] for a damaged block; each naming the file.
pub fn checksum_root_of_file(path: &Path, follow_symlinks: bool) -> Result<(u64, Option<Sum>)> {
    let (file, len, _) = io::open_regular(path, follow_symlinks)?;
    let too_large = || Error::integrity("the file is too large to address").in_file(path);
    let reader = Reader::new(&file, usize::try_from(len).map_err(|_| too_large())?, path);
    let Some(footer) = footer_of(&reader)? else {
        return Ok((len, None));
    };
    // The body streamed through the reader's window: a count that claims the whole file
    // costs a read of it, never its size in memory.
    let mut body = Running::default();
    let start = footer.start as usize;
    reader.feed(start, start + footer.body_len(), &mut body)?;
    if !footer.covers(body) {
        return Err(
            Error::integrity("the checksum block is damaged (its own checksum differs)")
                .in_file(path),
        );
    }
    Ok((len, Some(footer.root)))
}

/// A tensor's values filled in place after [`crate::write_staged`] (into its hole): where
/// they lie (the data file, or the checkpoint itself; the offset in that file) and their sum,
/// when the filler took it as it wrote them (in element order: [`checksums::Running`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Filled {
    pub external: bool,
    pub offset: u64,
    pub sum: Option<Sum>,
}

/// Writes the checksum block of a staged checkpoint again, for writers that fill values in
/// place after [`crate::write_staged`] (the block written then summed what the values were).
/// `filled`: None, every value is read and summed again; else the tensors filled, each with
/// the sum its filler took (a tensor without one is read and summed), the others keeping the
/// sums the writer took. The metadata is summed again either way (it is small).
///
/// # Errors
/// OS errors; a staged file that is no ortckpt checkpoint with a block; a filled tensor that
/// the checkpoint does not hold (or holds twice).
pub fn reseal(staged: &mut io::Staged, filled: Option<&[Filled]>) -> Result<()> {
    let main_path = staged.main().temp().to_path_buf();
    let data_path = staged.data().map(|d| d.temp().to_path_buf());
    let in_file = |e: Error| e.in_file(&main_path);
    let (map, _, _) = io::map_private(&main_path, false, 8, |len| {
        Error::malformed(format!(
            "file is too short to be a checkpoint ({len} bytes)"
        ))
    })?;
    let ckpt = crate::format::decode(&map).map_err(in_file)?;
    let data = match &data_path {
        Some(p) => io::map_private_any(p, false)?.0,
        None => None,
    };
    let block = checksums::find(&map, map.len() as u64)
        .map_err(|why| in_file(Error::integrity(why)))?
        .ok_or_else(|| {
            in_file(Error::invalid_state(
                "the staged checkpoint has no checksum block",
            ))
        })?;
    let sums = match filled {
        None => tensor_sums(&map, data.as_ref(), &ckpt, &block, |_, _| None),
        Some(filled) => {
            let place = |stored: &Stored| match *stored {
                Stored::Inline { offset, len } if len > 0 => Some((false, offset as u64)),
                Stored::External { offset, len } if len > 0 => Some((true, offset)),
                _ => None,
            };
            let mut held = HashMap::new();
            for t in ckpt.tensors() {
                if let Some(at) = place(&t.data) {
                    *held.entry(at).or_insert(0) += 1;
                }
            }
            let sums: HashMap<_, _> = filled
                .iter()
                .map(|f| ((f.external, f.offset), f.sum))
                .collect();
            let invalid = |why: String| in_file(Error::invalid_state(format!("reseal: {why}")));
            if sums.len() != filled.len() {
                return Err(invalid("a filled tensor is listed twice".to_owned()));
            }
            if let Some(f) = filled
                .iter()
                .find(|f| held.get(&(f.external, f.offset)) != Some(&1))
            {
                let file = if f.external {
                    "data file"
                } else {
                    "checkpoint"
                };
                return Err(invalid(format!(
                    "no one tensor's values lie at offset {} of the {file}",
                    f.offset
                )));
            }
            let known =
                |index: usize, stored: &Stored| match place(stored).and_then(|at| sums.get(&at)) {
                    Some(sum) => *sum,
                    None => block.tensors.get(index).copied(),
                };
            tensor_sums(&map, data.as_ref(), &ckpt, &block, known)
        }
    }
    .map_err(in_file)?;
    let metadata = metadata_sum(&map, &ckpt, &block).map_err(in_file)?;
    let id = match data_path {
        Some(_) => pairing::pair_id(&map).expect("find() saw the trailer"),
        None => checksums::content_id(&sums, metadata),
    };
    let mut bytes = checksums::block(&sums, metadata, &id);
    bytes.extend_from_slice(&pairing::trailer(&id));
    staged
        .main()
        .file()
        .write_all_at(&bytes, block.start as u64)
        .map_err(|e| in_file(e.into()))
}

/// Seals a staged checkpoint that another writer (ONNX Runtime's own saver) wrote whole into
/// the staged files, as any ortckpt save ends: the checksum block and the pair trailer appended
/// to the checkpoint, the trailer to its data file. Whether the pair has a data file is the
/// checkpoint's to say (its `has_external_data`): a staged data file it does not use is
/// dropped, uncommitted. Each value is read once, from the page cache the writer just filled.
///
/// # Errors
/// OS errors; a staged file that is no checkpoint, is sealed already, or has external data
/// with no data file staged.
pub fn seal_written(staged: &mut io::Staged) -> Result<()> {
    let main_path = staged.main().temp().to_path_buf();
    let in_file = |e: Error| e.in_file(&main_path);
    let (map, _, _) = io::map_private(&main_path, false, 8, |len| {
        Error::malformed(format!(
            "file is too short to be a checkpoint ({len} bytes)"
        ))
    })?;
    if pairing::pair_id(&map).is_some() {
        return Err(in_file(Error::invalid_state(
            "the staged checkpoint is sealed already",
        )));
    }
    let ckpt = crate::format::decode(&map).map_err(in_file)?;
    let external = ckpt.has_external_data;
    if !external {
        staged.drop_data();
    }
    let data = match staged.data() {
        Some(d) => io::map_private_any(d.temp(), false)?.0,
        None if external => {
            return Err(in_file(Error::invalid_state(
                "the checkpoint has external data and no data file is staged",
            )))
        }
        None => None,
    };
    // Nothing sealed yet: every sum is read, and the metadata runs to the file's end.
    let unsealed = Block {
        tensors: vec![0; ckpt.tensors().count()],
        metadata: 0,
        root: 0,
        start: map.len(),
    };
    let sums = tensor_sums(&map, data.as_ref(), &ckpt, &unsealed, |_, _| None).map_err(in_file)?;
    let metadata = metadata_sum(&map, &ckpt, &unsealed).map_err(in_file)?;
    let id = if external {
        checksums::marked(pairing::new_pair_id())
    } else {
        checksums::content_id(&sums, metadata)
    };
    let trailer = pairing::trailer(&id);
    if let (Some(data), Some(len)) = (staged.data(), data.as_ref().map(|d| d.len())) {
        data.file()
            .write_all_at(&trailer, len as u64)
            .map_err(|e| Error::from(e).in_file(data.temp()))?;
    } else if let Some(data) = staged.data() {
        // An empty data file (no value is external) still ends with the pair's trailer.
        data.file()
            .write_all_at(&trailer, 0)
            .map_err(|e| Error::from(e).in_file(data.temp()))?;
    }
    let mut bytes = checksums::block(&sums, metadata, &id);
    bytes.extend_from_slice(&trailer);
    staged
        .main()
        .file()
        .write_all_at(&bytes, map.len() as u64)
        .map_err(|e| in_file(e.into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{DataType, OptimizerGroup, ParameterOptimizerState, Payload, Tensor};
    use crate::io::both_ends::tests::FILLS;
    use crate::save::{save, SaveOptions};
    use std::os::unix::fs::PermissionsExt;

    fn float<'a>(name: &str, data: &'a [u8]) -> Tensor<Payload<'a>> {
        Tensor {
            name: name.into(),
            data_type: DataType::Float,
            dims: vec![(data.len() / 4) as i64],
            data: Payload::Bytes(data),
        }
    }

    /// (Here, above both the save and the check.) A save of 24 MiB into a private directory on tmpfs fills its files from both ends; it
    /// writes what the same save writes on disk, byte for byte where the save is deterministic
    /// (one file), value for value and checksums verified with external data.
    #[test]
    fn a_save_into_tmpfs_from_both_ends_writes_what_a_save_on_disk_writes() {
        let values: Vec<Vec<u8>> = (0..7)
            .map(|i| (0..(3 << 20) + 4 * i).map(|j| (j * 13 + i) as u8).collect())
            .collect();
        let ckpt = Checkpoint {
            trainable: values[..5]
                .iter()
                .enumerate()
                .map(|(i, v)| float(&format!("w{i}"), v))
                .collect(),
            optimizer_groups: vec![OptimizerGroup {
                name: "group0".into(),
                step: 3,
                initial_learning_rate: 0.1,
                states: vec![ParameterOptimizerState {
                    param_name: "w0".into(),
                    momentums: vec![
                        float("momentum0", &values[5]),
                        float("momentum1", &values[6]),
                    ],
                }],
            }],
            ..Default::default()
        };
        let tmpfs =
            tempfile::tempdir_in("/dev/shm").expect("/dev/shm, a tmpfs, is part of the machine");
        std::fs::set_permissions(tmpfs.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let disk = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        for threshold in [u64::MAX, 0] {
            let options = SaveOptions {
                external_data_threshold: threshold,
                ..SaveOptions::default()
            };
            let (on_tmpfs, on_disk) = (tmpfs.path().join("c"), disk.path().join("c"));
            let before = FILLS.with(std::cell::Cell::get);
            save(&on_tmpfs, &ckpt, &options).unwrap();
            assert_eq!(
                FILLS.with(std::cell::Cell::get),
                before + 1,
                "threshold {threshold}"
            );
            save(&on_disk, &ckpt, &options).unwrap();
            assert_eq!(FILLS.with(std::cell::Cell::get), before + 1, "not on disk");
            if threshold == u64::MAX {
                assert!(std::fs::read(&on_tmpfs).unwrap() == std::fs::read(&on_disk).unwrap());
            }
            let (a, b) = (
                crate::load(&on_tmpfs).unwrap(),
                crate::load(&on_disk).unwrap(),
            );
            assert!(matches!(
                a.verify_checksums().unwrap(),
                Checked::Verified { tensors: 7, .. }
            ));
            for (x, y) in a.checkpoint().tensors().zip(b.checkpoint().tensors()) {
                assert_eq!(x.name, y.name);
                assert!(a.bytes(x).unwrap() == b.bytes(y).unwrap(), "{}", x.name);
            }
        }
    }
}
