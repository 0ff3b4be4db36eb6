//! Saves that share an unchanged data file with the previous save instead of writing it again.
//!
//! A training run that saves step after step rewrites mostly the same bytes (frozen layers do
//! not change). When the previous checkpoint keeps its values in a data file, a new checkpoint
//! can point at the very same bytes: the data file is hard-linked beside it (`<path>.data`, the
//! only name ONNX Runtime reads external data from, at any offset), the tensors whose bytes are
//! equal to the previous ones are external at their offsets there, and the rest are inline in
//! the new checkpoint, whose pair trailer carries the data file's id (see
//! [`crate::seal::pairing`]). Each checkpoint stays whole on its own; deleting either
//! leaves the other intact (a hard link).
//!
//! "Equal" is decided by comparing bytes against the data file that gets linked (the inode
//! mapped is the inode linked, checked after linking): never by a checksum, never by trusting
//! what the previous checkpoint says. Or, where a tensor's bytes are not compared at all, by
//! identity: bytes that *are* that data file's at the very offset the previous checkpoint keeps
//! the tensor at (a mapping of it never written in this process, see [`io::FileBacked`]: a
//! frozen part restored from the previous step and not touched since) cannot have changed; or
//! by the page watch (`watched`, see [`crate::untouched`]): the caller's own
//! memory, none of whose pages was written since a save recorded where the previous data file
//! keeps its bytes, holds those bytes (only the part pages at either end are compared).
//! A value found unchanged either way takes the previous checkpoint's checksum for it (of the
//! same bytes) rather than being summed again. Nothing is ever written to the shared file.

use std::collections::HashMap;
use std::fs::{self, OpenOptions};
use std::io::ErrorKind as IoKind;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crate::error::{Error, Result};
use crate::format::encode::{encode_sharing, EXTERNAL_MIN_BYTES, MAX_INLINE_LEN};
use crate::format::{Checkpoint, Payload, Stored, Tensor};
use crate::io;
use crate::save::SaveOptions;
use crate::seal::checksums::{self, Sum};
use crate::seal::external_data_path;
use crate::seal::pairing;
use crate::untouched;

/// What a sharing save found and did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sharing {
    /// Whether the checkpoint was written and committed sharing the previous data file (linked
    /// as its own). When not, nothing was written: save the checkpoint whole instead.
    pub shared: bool,
    /// Bytes of values (tensors of [`EXTERNAL_MIN_BYTES`] or more) byte-identical to the
    /// previous checkpoint's, wherever it keeps them (inline too): how much a whole save with
    /// external data would let the next save share.
    pub unchanged: u64,
    /// Bytes of values in all.
    pub values: u64,
    /// Bytes of values compared byte for byte with the previous checkpoint's (the others were
    /// proven the same bytes, or had no counterpart to compare with).
    pub compared: u64,
}

/// Which tensor of a checkpoint: a parameter by name, or a momentum by group, parameter and name.
type Key<'c> = (bool, &'c str, &'c str, &'c str);

fn keyed<D>(ckpt: &Checkpoint<D>) -> impl Iterator<Item = (Key<'_>, &Tensor<D>)> {
    let params = ckpt
        .trainable
        .iter()
        .chain(&ckpt.frozen)
        .map(|t| ((false, "", "", t.name.as_str()), t));
    let momentums = ckpt.optimizer_groups.iter().flat_map(|g| {
        g.states.iter().flat_map(move |s| {
            s.momentums.iter().map(move |m| {
                let key = (
                    true,
                    g.name.as_str(),
                    s.param_name.as_str(),
                    m.name.as_str(),
                );
                (key, m)
            })
        })
    });
    params.chain(momentums)
}

/// Saves `ckpt` at `path` (which must not exist yet: a step's fresh directory), sharing what is
/// unchanged with the checkpoint at `previous` (its data file, `<previous>.data`, hard-linked
/// as `<path>.data`), or writes nothing and says so. With `compare_only`, nothing is written:
/// it only says how much is unchanged. `watched`: the values' pages, armed before this call
/// (see [`crate::untouched`]), so that those proven unwritten since a save recorded where the
/// previous data file keeps them need not be compared.
///
/// Shared only when the unchanged values in the previous data file fill at least half of it
/// (so a file that is mostly stale bytes is not kept alive step after step) and the changed ones
/// fit inline (ONNX Runtime's 2 GiB). Sorted like [`crate::save`] unless `options.keep_order`;
/// written and committed through the same staged files and commit; with `options.durable` the
/// linked data file is fsynced too (the previous save may not have been durable).
///
/// # Errors
/// As [`crate::save`]; [`crate::ErrorKind::InvalidState`] when `path` or `<path>.data` exists.
/// Whatever is wrong with the previous checkpoint (missing, damaged, symlinked, from ONNX
/// Runtime without a pair trailer) is no error: nothing is shared from it.
pub fn save_sharing(
    path: &Path,
    ckpt: &Checkpoint<Payload<'_>>,
    previous: &Path,
    compare_only: bool,
    watched: Option<&untouched::Armed>,
    options: &SaveOptions,
) -> Result<Sharing> {
    crate::format::endian::ensure_host_little_endian()?;
    let data_path = external_data_path(path);
    if fs::symlink_metadata(path).is_ok() || fs::symlink_metadata(&data_path).is_ok() {
        return Err(Error::invalid_state(
            "a sharing save writes a new checkpoint: the path (or its data file) exists already",
        )
        .in_file(path));
    }
    let sorted;
    let ckpt = if options.keep_order {
        ckpt
    } else {
        sorted = ckpt.sorted_like_ort_state_path();
        &sorted
    };
    let values: u64 = ckpt
        .tensors()
        .filter_map(bytes_of)
        .map(|b| b.len() as u64)
        .sum();
    let mut sharing = Sharing {
        shared: false,
        unchanged: 0,
        values,
        compared: 0,
    };
    if ckpt.is_nominal {
        return Ok(sharing);
    }
    let Some(before) = Previous::open(previous) else {
        return Ok(sharing);
    };
    let (offsets, sums) = before.unchanged(ckpt, &mut sharing, watched);
    let Some((data, data_id, file)) = before.data.as_ref().filter(|_| !compare_only) else {
        return Ok(sharing); // nothing external to share (an inline checkpoint), or not asked to
    };
    let (mut shared_len, mut inline_len) = (0u64, 0u64);
    for (t, offset) in ckpt.tensors().zip(&offsets) {
        let len = bytes_of(t).map_or(0, |b| b.len() as u64);
        *(if offset.is_some() {
            &mut shared_len
        } else {
            &mut inline_len
        }) += len;
    }
    if shared_len == 0 || 2 * shared_len < data.len() as u64 || inline_len > MAX_INLINE_LEN {
        return Ok(sharing);
    }
    let mut encoded = match encode_sharing(ckpt, &file.pair, &offsets, &sums) {
        Ok(encoded) => encoded,
        // Past the inline limit once the tables are counted too: saved whole instead.
        Err(_) if inline_len + (64 << 20) > MAX_INLINE_LEN => return Ok(sharing),
        Err(e) => return Err(e.in_file(path)),
    };
    // The checksums of the values, shared and inline, from the caller's bytes (the shared ones
    // equal the data file's: compared or proven above, and their sums the previous checkpoint's
    // where it has them), before the checkpoint file is written.
    encoded.seal_from_memory();
    let segments = encoded.segments();
    let unobserved = io::Progress::default();
    let progress = options.progress.as_deref().unwrap_or(&unobserved);
    progress.begin(segments.iter().map(|s| s.len() as u64).sum());
    let after = io::AfterEachPiece {
        writeback: options.durable,
        progress,
    };

    let mut staged = io::Staged::new(path, false)?;
    match fs::hard_link(external_data_path(previous), &data_path) {
        Ok(()) => {}
        // A filesystem without hard links (or across devices), a file with as many links as
        // the filesystem allows (ext4: 65,000, reached by a long run that keeps every step),
        // or a previous step deleted meanwhile: saved whole instead (the next steps share the
        // new file).
        Err(e)
            if matches!(
                e.kind(),
                IoKind::Unsupported | IoKind::CrossesDevices | IoKind::NotFound
            ) || matches!(e.raw_os_error(), Some(libc::EPERM | libc::EMLINK)) =>
        {
            return Ok(sharing)
        }
        Err(e) => return Err(Error::from(e).in_file(&data_path)),
    }
    // From here on, the link is ours to remove should the save not commit.
    let linked = Linked(&data_path);
    if io::FileId::of_name(&data_path) != Some(*data_id) {
        // The previous data file was replaced between the comparison and the link: what is
        // linked is not what was compared.
        return Ok(sharing);
    }
    if options.durable {
        OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&data_path)
            .and_then(|f| f.sync_all())
            .map_err(|e| Error::from(e).in_file(&data_path))?;
    }
    // (Sealed above: nothing to sum as it goes.)
    crate::save::write_body(
        staged.main().file(),
        &segments,
        &vec![None; segments.len()],
        &std::collections::HashSet::new(),
        options.threads,
        &after,
    )
    .map_err(|e| Error::from(e).in_file(path))?;
    staged.commit(&io::CommitOptions {
        durable: options.durable,
        lock_timeout: options.lock_timeout,
        unpaired: false,
    })?;
    linked.keep();
    sharing.shared = true;
    Ok(sharing)
}

/// Where the committed checkpoint at `path` keeps each value of `ckpt` (the checkpoint it was
/// saved from) in its data file: the value's bytes in memory and that place, for
/// [`untouched::record`]. Read back from the file itself; none without a data file of ours.
pub fn stored_origins<'a>(
    path: &Path,
    ckpt: &Checkpoint<Payload<'a>>,
) -> Vec<(&'a [u8], untouched::Origin)> {
    let Some(Previous {
        checkpoint,
        data: Some((_, _, file)),
        ..
    }) = Previous::open(path)
    else {
        return Vec::new();
    };
    let stored: HashMap<Key<'_>, u64> = keyed(&checkpoint)
        .filter_map(|(key, t)| match t.data {
            Stored::External { offset, .. } => Some((key, offset)),
            _ => None,
        })
        .collect();
    keyed(ckpt)
        .filter_map(|(key, t)| Some((bytes_of(t)?, (file, *stored.get(&key)?))))
        .collect()
}

/// Removes the hard link it names when dropped, unless kept (the save committed).
struct Linked<'p>(&'p Path);

impl Linked<'_> {
    fn keep(self) {
        std::mem::forget(self);
    }
}

impl Drop for Linked<'_> {
    fn drop(&mut self) {
        let _ = fs::remove_file(self.0);
    }
}

fn bytes_of<'a>(t: &Tensor<Payload<'a>>) -> Option<&'a [u8]> {
    match t.data {
        Payload::Bytes(bytes) => Some(bytes),
        _ => None,
    }
}

/// The previous checkpoint, mapped as it is now (never following a symlink): its file, its
/// decoded tables, and its data file when it has one of ours (a pair trailer matching the
/// checkpoint's): the mapping, its inode (the one to link) and the file as it is now (its pair
/// id, and what the page watch's records name it by: see [`untouched::DataFile`]).
struct Previous {
    map: memmap2::MmapMut,
    checkpoint: Checkpoint<Stored>,
    data: Option<(memmap2::MmapMut, io::FileId, untouched::DataFile)>,
    /// Its checksum block's sum of each tensor (in [`Checkpoint::tensors`] order), when it has
    /// one whose own root checks.
    sums: Option<Vec<Sum>>,
}

impl Previous {
    fn open(path: &Path) -> Option<Previous> {
        let (map, _, _) =
            io::map_private(path, false, 8, |_| Error::malformed("too short")).ok()?;
        let checkpoint = crate::format::decode(&map).ok()?;
        let mut data = None;
        if checkpoint.has_external_data {
            if let Ok((Some(mapped), id, file)) =
                io::map_private_any(&external_data_path(path), false)
            {
                // Only a data file whose id marks it as carrying checksums (a checkpoint sharing it
                // takes its id, and a block's id must say so: see seal::checksums).
                let pair = pairing::pair_id(&mapped)
                    .filter(|&p| pairing::pair_id(&map) == Some(p) && checksums::marked(p) == p);
                // (named as it is now, for the page watch's records: see untouched::DataFile)
                let named = pair.zip(file.metadata().ok());
                data = named.map(|(p, meta)| (mapped, id, untouched::DataFile::of(p, &meta)));
            }
        }
        let sums = checksums::find(&map, map.len() as u64)
            .ok()
            .flatten()
            .map(|block| block.tensors)
            .filter(|sums| sums.len() == checkpoint.tensors().count());
        Some(Previous {
            map,
            checkpoint,
            data,
            sums,
        })
    }

    /// A tensor's bytes as the previous checkpoint keeps them, and its offset in the data file
    /// when external (values past the data file's end, or into its trailer, are none).
    fn bytes(&self, t: &Tensor<Stored>) -> Option<(&[u8], Option<u64>)> {
        match t.data {
            Stored::Inline { offset, len } => {
                Some((self.map.get(offset..offset.checked_add(len)?)?, None))
            }
            Stored::External { offset, len } => {
                let (data, ..) = self.data.as_ref()?;
                let values = &data[..data.len() - pairing::PAIR_TRAILER_LEN];
                let end = usize::try_from(offset.checked_add(len)?).ok()?;
                Some((
                    values.get(usize::try_from(offset).ok()?..end)?,
                    Some(offset),
                ))
            }
            _ => None,
        }
    }

    /// For each tensor of `ckpt` (in [`Checkpoint::tensors`] order) whose bytes, type and dims
    /// equal the previous checkpoint's, and which it keeps in its data file: that offset, and
    /// the previous checkpoint's checksum of it when it has one. Bytes that are the data file's
    /// own at that offset ([`io::FileBacked`]) are equal without being compared. The bytes of
    /// all the equal ones (inline too) are added to `sharing.unchanged`, those compared to
    /// `sharing.compared`.
    fn unchanged(
        &self,
        ckpt: &Checkpoint<Payload<'_>>,
        sharing: &mut Sharing,
        armed: Option<&untouched::Armed>,
    ) -> (Vec<Option<u64>>, Vec<Option<Sum>>) {
        let before: HashMap<Key<'_>, (usize, &Tensor<Stored>)> = keyed(&self.checkpoint)
            .enumerate()
            .map(|(index, (key, t))| (key, (index, t)))
            .collect();
        let data_id = self.data.as_ref().map(|(_, id, _)| *id);
        let data_file = self.data.as_ref().map(|(_, _, file)| *file);
        // (only asked where a data file could hold a tensor's own bytes)
        let backed = data_id.and_then(|_| io::FileBacked::read());
        // What was found equal, for the page watch (see untouched::settle).
        let mut equal = Vec::new();
        let found = keyed(ckpt)
            .map(|(key, t)| {
                let bytes = bytes_of(t).filter(|b| b.len() >= EXTERNAL_MIN_BYTES)?;
                let &(index, was) = before.get(&key)?;
                if was.data_type != t.data_type || was.dims != t.dims {
                    return None;
                }
                let (was_bytes, offset) = self.bytes(was)?;
                if was_bytes.len() != bytes.len() {
                    return None;
                }
                let the_same_bytes = match (&backed, data_id, offset) {
                    (Some(backed), Some(id), Some(offset)) => {
                        backed.span(bytes) == Some((id, offset))
                    }
                    _ => false,
                };
                let watched = match (armed, data_file, offset) {
                    (Some(armed), Some(file), Some(offset)) if !the_same_bytes => {
                        armed.proves(bytes, (file, offset))
                    }
                    _ => None,
                };
                if let Some((start, end)) = watched {
                    // The whole pages in between are proven; the part pages at the ends are not.
                    sharing.compared += (start + bytes.len() - end) as u64;
                    if was_bytes[..start] != bytes[..start] || was_bytes[end..] != bytes[end..] {
                        return None;
                    }
                } else if !the_same_bytes {
                    sharing.compared += bytes.len() as u64;
                    if was_bytes != bytes {
                        return None;
                    }
                }
                sharing.unchanged += bytes.len() as u64;
                equal.push(bytes);
                let sum = self.sums.as_ref().map(|sums| sums[index]);
                Some((offset?, sum))
            })
            .map(|found| (found.map(|(o, _)| o), found.and_then(|(_, s)| s)))
            .unzip();
        if armed.is_some() {
            untouched::settle(equal.into_iter());
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::DataType;
    use std::os::unix::fs::MetadataExt;

    fn tensor<'a>(name: &str, bytes: &'a [u8]) -> Tensor<Payload<'a>> {
        Tensor {
            name: name.to_owned(),
            dims: vec![bytes.len() as i64],
            data_type: DataType::Uint8,
            data: Payload::Bytes(bytes),
        }
    }

    fn checkpoint<'a>(frozen: &'a [u8], trainable: &'a [u8]) -> Checkpoint<Payload<'a>> {
        let mut ckpt = Checkpoint::default();
        ckpt.frozen.push(tensor("frozen", frozen));
        ckpt.trainable.push(tensor("trainable", trainable));
        ckpt
    }

    fn external() -> SaveOptions {
        SaveOptions {
            external_data_threshold: 0,
            ..SaveOptions::default()
        }
    }

    #[test]
    fn unchanged_values_share_the_data_file_and_changed_ones_go_inline() {
        let dir = tempfile::tempdir().unwrap();
        let (first, second) = (dir.path().join("a"), dir.path().join("b"));
        let frozen = vec![7u8; 100_000];
        crate::save(&first, &checkpoint(&frozen, &[1; 1000]), &external()).unwrap();
        let changed = vec![2u8; 1000];
        let sharing = save_sharing(
            &second,
            &checkpoint(&frozen, &changed),
            &first,
            false,
            None,
            &external(),
        );
        let expected = Sharing {
            shared: true,
            unchanged: 100_000,
            values: 101_000,
            compared: 101_000,
        };
        assert_eq!(sharing.unwrap(), expected);
        let (a, b) = (external_data_path(&first), external_data_path(&second));
        let (a, b) = (fs::metadata(a).unwrap(), fs::metadata(b).unwrap());
        assert_eq!((a.ino(), a.nlink()), (b.ino(), 2));
        let loaded = crate::load(&second).unwrap();
        let c = loaded.checkpoint();
        assert_eq!(loaded.bytes(&c.frozen[0]).unwrap(), &frozen[..]);
        assert_eq!(loaded.bytes(&c.trainable[0]).unwrap(), &changed[..]);
        assert!(matches!(c.trainable[0].data, Stored::Inline { .. }));
    }

    #[test]
    fn one_changed_byte_is_never_shared_and_too_little_shared_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (first, second) = (dir.path().join("a"), dir.path().join("b"));
        let mut frozen = vec![7u8; 100_000];
        crate::save(&first, &checkpoint(&frozen, &[1; 1000]), &external()).unwrap();
        frozen[54_321] ^= 1;
        let sharing = save_sharing(
            &second,
            &checkpoint(&frozen, &[1; 1000]),
            &first,
            false,
            None,
            &external(),
        );
        // Only the 1000 trainable bytes are unchanged: not worth keeping 100 kB alive for.
        let sharing = sharing.unwrap();
        assert!(!sharing.shared && sharing.unchanged == 1000);
        assert!(!second.exists() && !external_data_path(&second).exists());
    }

    #[test]
    fn a_previous_checkpoint_without_data_file_or_pair_shares_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (first, second) = (dir.path().join("a"), dir.path().join("b"));
        let frozen = vec![7u8; 100_000];
        crate::save(
            &first,
            &checkpoint(&frozen, &[1; 100]),
            &SaveOptions::default(),
        )
        .unwrap();
        let ckpt = checkpoint(&frozen, &[1; 100]);
        let sharing = save_sharing(&second, &ckpt, &first, false, None, &external()).unwrap();
        // Inline: all of it unchanged, nothing to share from.
        assert!(!sharing.shared && sharing.unchanged == 100_100 && !second.exists());
        // The previous checkpoint's data file from another save (its pair id differs).
        let other = dir.path().join("o");
        crate::save(&other, &ckpt, &external()).unwrap();
        crate::save(&first, &ckpt, &external()).unwrap();
        fs::copy(external_data_path(&other), external_data_path(&first)).unwrap();
        let sharing = save_sharing(&second, &ckpt, &first, false, None, &external()).unwrap();
        assert!(!sharing.shared && !second.exists());
    }

    /// The previous checkpoint's data file mapped privately, as a restored state maps it, and
    /// where its frozen tensor's bytes lie in it.
    fn mapped_frozen(first: &Path) -> (memmap2::MmapMut, std::ops::Range<usize>) {
        let loaded = crate::load(first).unwrap();
        let Stored::External { offset, len } = loaded.checkpoint().frozen[0].data else {
            panic!("the frozen tensor is external");
        };
        let file = fs::File::open(external_data_path(first)).unwrap();
        let map = unsafe { memmap2::MmapOptions::new().map_copy(&file) }.unwrap();
        (map, offset as usize..(offset + len) as usize)
    }

    #[test]
    fn bytes_that_are_the_previous_data_files_are_shared_without_comparing() {
        let dir = tempfile::tempdir().unwrap();
        let [first, second, third] = ["a", "b", "c"].map(|n| dir.path().join(n));
        let frozen: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        crate::save(&first, &checkpoint(&frozen, &[1; 1000]), &external()).unwrap();
        let (map, at) = mapped_frozen(&first);
        let ckpt = checkpoint(&map[at.clone()], &[2; 1000]);
        let sharing = save_sharing(&second, &ckpt, &first, false, None, &external()).unwrap();
        let expected = Sharing {
            shared: true,
            unchanged: 100_000,
            values: 101_000,
            compared: 1000, // the trainable values only
        };
        assert_eq!(sharing, expected);
        // Whole on its own: the shared bytes and the checksum taken from the first checkpoint.
        let loaded = crate::load(&second).unwrap();
        loaded.verify_checksums().unwrap();
        assert_eq!(
            loaded.bytes(&loaded.checkpoint().frozen[0]).unwrap(),
            &frozen[..]
        );
        // The same mapping against the second checkpoint: the same data file (a hard link).
        let sharing = save_sharing(&third, &ckpt, &second, false, None, &external()).unwrap();
        assert_eq!((sharing.shared, sharing.compared), (true, 1000));
        crate::load(&third).unwrap().verify_checksums().unwrap();
    }

    #[test]
    fn a_written_page_of_the_mapped_data_file_is_compared_and_its_new_bytes_kept() {
        let dir = tempfile::tempdir().unwrap();
        let [first, second, third] = ["a", "b", "c"].map(|n| dir.path().join(n));
        let frozen = vec![7u8; 100_000];
        crate::save(&first, &checkpoint(&frozen, &[1; 1000]), &external()).unwrap();
        let (mut map, at) = mapped_frozen(&first);
        // Written with the byte it held: a private copy now, no longer the file's own page.
        map[at.start + 50_000] = 7;
        let ckpt = checkpoint(&map[at.clone()], &[1; 1000]);
        let sharing = save_sharing(&second, &ckpt, &first, false, None, &external()).unwrap();
        assert_eq!((sharing.shared, sharing.compared), (true, 101_000));
        crate::load(&second).unwrap().verify_checksums().unwrap();
        // A changed byte: compared, found changed, never shared.
        map[at.start + 50_000] = 8;
        let ckpt = checkpoint(&map[at.clone()], &[1; 1000]);
        let sharing = save_sharing(&third, &ckpt, &first, false, None, &external()).unwrap();
        assert_eq!((sharing.shared, sharing.unchanged), (false, 1000));
        assert!(!third.exists());
        // Another file's mapping of equal bytes is no proof either: compared.
        let other = dir.path().join("o");
        crate::save(&other, &checkpoint(&frozen, &[1; 1000]), &external()).unwrap();
        let (map, at) = mapped_frozen(&other);
        let ckpt = checkpoint(&map[at], &[1; 1000]);
        let sharing = save_sharing(&third, &ckpt, &first, false, None, &external()).unwrap();
        assert_eq!((sharing.shared, sharing.compared), (true, 101_000));
        let loaded = crate::load(&third).unwrap();
        loaded.verify_checksums().unwrap();
        assert_eq!(
            loaded.bytes(&loaded.checkpoint().frozen[0]).unwrap(),
            &frozen[..]
        );
    }

    #[test]
    fn compare_only_writes_nothing_and_counts_what_is_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let (first, second) = (dir.path().join("a"), dir.path().join("b"));
        let frozen = vec![7u8; 100_000];
        let ckpt = checkpoint(&frozen, &[1; 1000]);
        crate::save(&first, &ckpt, &external()).unwrap();
        let sharing = save_sharing(&second, &ckpt, &first, true, None, &external()).unwrap();
        assert!(!sharing.shared && sharing.unchanged == 101_000 && !second.exists());
    }

    #[test]
    fn an_existing_target_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let first = dir.path().join("a");
        let frozen = vec![7u8; 1000];
        let ckpt = checkpoint(&frozen, &[1; 100]);
        crate::save(&first, &ckpt, &external()).unwrap();
        assert!(save_sharing(&first, &ckpt, &first, false, None, &external()).is_err());
    }

    #[test]
    fn watched_values_unwritten_since_recorded_are_not_compared_and_a_written_one_is() {
        let _serial = untouched::TEST_SERIAL
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let path = |n: usize| dir.path().join(format!("step{n}"));
        // Two values of the caller's own memory: "frozen" and (named so, never trained here)
        // "trainable".
        let frozen = vec![7u8; 64 * 4096 + 100];
        let mut other = vec![9u8; 48 * 4096 + 10];
        let edges = |v: &[u8]| {
            let first = v.as_ptr() as usize;
            let whole = ((first + v.len()) & !4095) - ((first + 4095) & !4095);
            (v.len() - whole) as u64
        };
        let watched_save = |n: usize, other: &[u8]| {
            let ckpt = checkpoint(&frozen, other);
            let armed = untouched::arm(ckpt.tensors().filter_map(bytes_of)).expect("a watch");
            let sharing = if n == 1 {
                crate::save(&path(1), &ckpt, &external()).unwrap();
                None
            } else {
                let sharing = save_sharing(
                    &path(n),
                    &ckpt,
                    &path(n - 1),
                    false,
                    Some(&armed),
                    &external(),
                );
                Some(sharing.unwrap())
            };
            untouched::record(&armed, stored_origins(&path(n), &ckpt).into_iter());
            sharing
        };

        // Step 1, whole; step 2 compares both values and finds them unchanged; step 3 watches
        // them from before it reads them (compared still: nothing recorded yet) and records where
        // they are; step 4 proves each value's whole pages, comparing only its part pages.
        watched_save(1, &other);
        let whole = (frozen.len() + other.len()) as u64;
        assert_eq!(watched_save(2, &other).unwrap().compared, whole);
        assert_eq!(watched_save(3, &other).unwrap().compared, whole);
        let sharing = watched_save(4, &other).unwrap();
        assert!(sharing.shared);
        assert_eq!(sharing.compared, edges(&frozen) + edges(&other));

        // A byte of one written in its middle: that one compared whole, and saved with its
        // new value; the other still proven.
        other[30 * 4096 + 5] ^= 0xFF;
        let sharing = watched_save(5, &other).unwrap();
        assert!(sharing.shared);
        assert_eq!(sharing.compared, edges(&frozen) + other.len() as u64);
        let loaded = crate::load(&path(5)).unwrap();
        let c = loaded.checkpoint();
        assert_eq!(loaded.bytes(&c.trainable[0]).unwrap(), &other[..]);
        assert_eq!(loaded.bytes(&c.frozen[0]).unwrap(), &frozen[..]);
    }
}
