//! Saves that share an unchanged data file with the previous save instead of writing it again.
//!
//! A training run that saves step after step rewrites mostly the same bytes (frozen layers do
//! not change). When the previous checkpoint keeps its values in a data file, a new checkpoint
//! can point at the very same bytes: the data file is hard-linked beside it (`<path>.data`, the
//! only name ONNX Runtime reads external data from, at any offset), the tensors whose bytes are
//! equal to the previous ones are external at their offsets there, and the rest are inline in
//! the new checkpoint, whose pair trailer carries the data file's id (see
//! [`crate::format::pairing`]). Each checkpoint stays whole on its own; deleting either
//! leaves the other intact (a hard link).
//!
//! "Equal" is decided by comparing bytes against the data file that gets linked (the inode
//! mapped is the inode linked, checked after linking): never by a checksum, never by trusting
//! what the previous checkpoint says. Nothing is ever written to the shared file.

use std::collections::HashMap;
use std::fs::{self, OpenOptions};
use std::io::ErrorKind as IoKind;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crate::error::{Error, Result};
use crate::format::encode::{encode_sharing, EXTERNAL_MIN_BYTES, MAX_INLINE_LEN};
use crate::format::{pairing, Checkpoint, DataType, Payload, Stored, Tensor};
use crate::{external_data_path, io, SaveOptions};

/// What a sharing save did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shared {
    /// The checkpoint is written and committed, sharing this many bytes of values with the
    /// previous one's data file (linked as its own).
    Bytes(u64),
    /// Nothing was written: too little is unchanged to be worth sharing (or there is nothing to
    /// share from, or the filesystem cannot hard-link); save the checkpoint whole instead.
    NotWorth,
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
                let key = (true, g.name.as_str(), s.param_name.as_str(), m.name.as_str());
                (key, m)
            })
        })
    });
    params.chain(momentums)
}

/// Saves `ckpt` at `path` (which must not exist yet: a step's fresh directory), sharing what is
/// unchanged with the checkpoint at `previous` (its data file, `<previous>.data`, hard-linked
/// as `<path>.data`), or writes nothing and says [`Shared::NotWorth`].
///
/// Shared only when the values that are unchanged fill at least half of the previous data file
/// (so a file that is mostly stale bytes is not kept alive step after step) and the changed ones
/// fit inline (ONNX Runtime's 2 GiB). Sorted like [`crate::save`] unless `options.keep_order`;
/// written and committed through the same staged files and commit; with `options.durable` the
/// linked data file is fsynced too (the previous save may not have been durable).
///
/// # Errors
/// As [`crate::save`]; [`crate::ErrorKind::InvalidState`] when `path` or `<path>.data` exists.
/// Whatever is wrong with the previous checkpoint (missing, damaged, symlinked, from ONNX
/// Runtime without a pair trailer) is no error: it is [`Shared::NotWorth`].
pub fn save_sharing(
    path: &Path,
    ckpt: &Checkpoint<Payload<'_>>,
    previous: &Path,
    options: &SaveOptions,
) -> Result<Shared> {
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
    if ckpt.is_nominal {
        return Ok(Shared::NotWorth);
    }
    let previous_data = external_data_path(previous);
    // The data file as it is now: these bytes are compared, and this inode is linked.
    let Ok((Some(data), data_id)) = io::map_private_any(&previous_data, false) else {
        return Ok(Shared::NotWorth);
    };
    let Some(pair_id) = pairing::pair_id(&data) else {
        return Ok(Shared::NotWorth); // not ours (ONNX Runtime's): no id to tie a new checkpoint to
    };
    let values_end = (data.len() - pairing::PAIR_TRAILER_LEN) as u64;
    let Some(offsets) = unchanged(ckpt, previous, &data[..values_end as usize], &pair_id) else {
        return Ok(Shared::NotWorth);
    };
    let shared_len: u64 = ckpt
        .tensors()
        .zip(&offsets)
        .filter(|(_, o)| o.is_some())
        .map(|(t, _)| bytes_of(t).map_or(0, |b| b.len() as u64))
        .sum();
    let inline_len: u64 = ckpt
        .tensors()
        .zip(&offsets)
        .filter(|(_, o)| o.is_none())
        .map(|(t, _)| bytes_of(t).map_or(0, |b| b.len() as u64))
        .sum();
    if shared_len == 0 || 2 * shared_len < data.len() as u64 || inline_len > MAX_INLINE_LEN {
        return Ok(Shared::NotWorth);
    }
    let encoded = match encode_sharing(ckpt, &pair_id, &offsets) {
        Ok(encoded) => encoded,
        // Past the inline limit once the tables are counted too: saved whole instead.
        Err(_) if inline_len + (64 << 20) > MAX_INLINE_LEN => return Ok(Shared::NotWorth),
        Err(e) => return Err(e.in_file(path)),
    };
    let segments = encoded.segments();
    let unobserved = io::Progress::default();
    let progress = options.progress.as_deref().unwrap_or(&unobserved);
    progress.begin(segments.iter().map(|s| s.len() as u64).sum());
    let after = io::AfterEachPiece {
        writeback: options.durable,
        progress,
    };

    let mut staged = io::Staged::new(path, false)?;
    match fs::hard_link(&previous_data, &data_path) {
        Ok(()) => {}
        // A filesystem without hard links (or across devices): saved whole instead.
        Err(e) if matches!(e.kind(), IoKind::Unsupported | IoKind::CrossesDevices)
            || e.raw_os_error() == Some(libc::EPERM) =>
        {
            return Ok(Shared::NotWorth)
        }
        Err(e) => return Err(Error::from(e).in_file(&data_path)),
    }
    // From here on, the link is ours to remove should the save not commit.
    let linked = Linked(&data_path);
    if io::FileId::of_name(&data_path) != Some(data_id) {
        // The previous data file was replaced between the comparison and the link: what is
        // linked is not what was compared.
        return Ok(Shared::NotWorth);
    }
    if options.durable {
        OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&data_path)
            .and_then(|f| f.sync_all())
            .map_err(|e| Error::from(e).in_file(&data_path))?;
    }
    io::write_segments(staged.main().file(), &segments, &after)
        .map_err(|e| Error::from(e).in_file(path))?;
    staged.commit(&io::CommitOptions {
        durable: options.durable,
        lock_timeout: options.lock_timeout,
        unpaired: false,
    })?;
    linked.keep();
    Ok(Shared::Bytes(shared_len))
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

/// For each tensor of `ckpt` (in [`Checkpoint::tensors`] order), the offset in `data` (the
/// previous data file's values) where the previous checkpoint kept the very same bytes, of the
/// same type and dims; None where they differ. None in all when the previous checkpoint cannot
/// be read or is not `data`'s pair.
fn unchanged(
    ckpt: &Checkpoint<Payload<'_>>,
    previous: &Path,
    data: &[u8],
    pair_id: &pairing::PairId,
) -> Option<Vec<Option<u64>>> {
    let (map, _) = io::map_private(previous, false, 8, |_| Error::malformed("too short")).ok()?;
    if pairing::pair_id(&map) != Some(*pair_id) {
        return None;
    }
    let before = crate::format::decode(&map).ok()?;
    let external: HashMap<Key<'_>, (DataType, &[i64], &[u8])> = keyed(&before)
        .filter_map(|(key, t)| match t.data {
            Stored::External { offset, len } => {
                let end = offset.checked_add(len).filter(|&end| end <= data.len() as u64)?;
                let bytes = &data[offset as usize..end as usize];
                Some((key, (t.data_type, t.dims.as_slice(), bytes)))
            }
            _ => None,
        })
        .collect();
    let start = data.as_ptr() as usize;
    Some(
        keyed(ckpt)
            .map(|(key, t)| {
                let bytes = bytes_of(t).filter(|b| b.len() >= EXTERNAL_MIN_BYTES)?;
                let &(data_type, dims, was) = external.get(&key)?;
                let same = data_type == t.data_type && dims == t.dims.as_slice() && was == bytes;
                same.then(|| (was.as_ptr() as usize - start) as u64)
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
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
        let shared = save_sharing(&second, &checkpoint(&frozen, &changed), &first, &external());
        assert_eq!(shared.unwrap(), Shared::Bytes(100_000));
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
        let shared = save_sharing(&second, &checkpoint(&frozen, &[1; 1000]), &first, &external());
        // Only the 1000 trainable bytes are unchanged: not worth keeping 100 kB alive for.
        assert_eq!(shared.unwrap(), Shared::NotWorth);
        assert!(!second.exists() && !external_data_path(&second).exists());
    }

    #[test]
    fn a_previous_checkpoint_without_data_file_or_pair_shares_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (first, second) = (dir.path().join("a"), dir.path().join("b"));
        let frozen = vec![7u8; 100_000];
        crate::save(&first, &checkpoint(&frozen, &[1; 100]), &SaveOptions::default()).unwrap();
        let ckpt = checkpoint(&frozen, &[1; 100]);
        let shared = save_sharing(&second, &ckpt, &first, &external()).unwrap();
        assert_eq!(shared, Shared::NotWorth);
        // The previous checkpoint's data file from another save (its pair id differs).
        let other = dir.path().join("o");
        crate::save(&other, &ckpt, &external()).unwrap();
        crate::save(&first, &ckpt, &external()).unwrap();
        fs::copy(external_data_path(&other), external_data_path(&first)).unwrap();
        let shared = save_sharing(&second, &ckpt, &first, &external()).unwrap();
        assert_eq!(shared, Shared::NotWorth);
    }

    #[test]
    fn an_existing_target_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let first = dir.path().join("a");
        let frozen = vec![7u8; 1000];
        let ckpt = checkpoint(&frozen, &[1; 100]);
        crate::save(&first, &ckpt, &external()).unwrap();
        assert!(save_sharing(&first, &ckpt, &first, &external()).is_err());
    }
}
